"""Sessions: the independent policy states of one engine, one record each, addressed by index
or name."""

import numpy as np

from .errors import InvalidConfig


class Session:
    """One session: its views of the arena, and host mirrors of its counters and lineage (the
    device holds the truth in meta; these follow it deterministically from what each operation
    did). Plain attributes: a single-session engine's step and capsule calls read and write
    them several times each (FleetSession keeps a fleet's in one array)."""

    STEP, EPISODE, POSITION, ROLLBACK = range(4)

    def __init__(self, index, name, views):
        self.index, self.name = index, name
        self.views = views          # its typed arena views, meta included
        self.lineage = ''           # the capsule the live state descends from (manifest.parent)
        self.step_index = self.episode = self.position = self.rollback_available = 0

    def __repr__(self):
        return (f'Session({self.index}, {self.name!r}, step {self.step_index}, episode '
                f'{self.episode}, position {self.position})')


def _counter(column):
    """A FleetSession attribute stored in column `column` of the fleet's counters array."""
    def get(self):
        return int(self.counters[self.index, column])

    def set(self, value):
        self.counters[self.index, column] = value
    return property(get, set)


class FleetSession(Session):
    """A session of a fleet: its counters are its row of one int64 array (Sessions.counters),
    so a tick updates every session's in a few numpy operations; read here as plain ints."""

    step_index = _counter(Session.STEP)
    episode = _counter(Session.EPISODE)
    position = _counter(Session.POSITION)
    rollback_available = _counter(Session.ROLLBACK)

    def __init__(self, index, name, views, counters):
        self.counters = counters
        super().__init__(index, name, views)


class Sessions:
    """The sessions of an arena in index order, with their names (default '0', '1', ...)."""

    def __init__(self, arena, names=None):
        count = arena.sessions
        names = [str(i) for i in range(count)] if names is None else [str(n) for n in names]
        if len(names) != count or len(set(names)) != len(names) or not all(names):
            raise InvalidConfig(f'session_names must be {count} distinct non-empty '
                                f'names, got {names}')
        clash = [n for i, n in enumerate(names)
                 if n.isascii() and n.isdigit() and int(n) != i]   # find(): ASCII indices
        if clash:
            raise InvalidConfig(f'session names {clash} read as the index of another session')
        # a fleet's counters, per session: step_index, episode, position, rollback_available
        self.counters = np.zeros((count, 4), dtype=np.int64)
        records = zip(range(count), names, arena.session_views)
        self._records = [Session(*r) for r in records] if count == 1 else \
            [FleetSession(*r, self.counters) for r in records]
        self._by_name = {s.name: s for s in self._records}

    def __iter__(self):
        return iter(self._records)

    def __len__(self):
        return len(self._records)

    def __getitem__(self, index):
        return self._records[index]

    @property
    def names(self):
        return [s.name for s in self._records]

    def find(self, key=None):
        """The Session for an index (int or decimal string) or a name. None or '' is the only
        session of a single-session engine; with several, leaving it out is refused (a
        capsule operation on a guessed robot would change the wrong robot's actions)."""
        count = len(self._records)
        if key is None or key == '':
            if count == 1:
                return self._records[0]
            raise InvalidConfig(f'this engine runs {count} sessions: name one '
                                f'(an index 0..{count - 1} or a name)')
        if isinstance(key, str) and key in self._by_name:
            return self._by_name[key]
        if isinstance(key, str) and key.isdigit() and not key.isascii():
            # str.isdigit and int() read other scripts' digits ('\u0661', fullwidth '\uff11')
            # and isdigit superscripts int() refuses ('\u00b2'): an index is 0-9 only
            raise InvalidConfig(f'no session {key!r}: an index is written in ASCII digits '
                                f'0-9 (0..{count - 1}), and no session has that name')
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < count:
            return self._records[key]
        names = ', '.join(s.name for s in self._records[:8])
        more = ', ...' if count > 8 else ''
        raise InvalidConfig(f'no session {key!r}: indices are 0..{count - 1}, names '
                            f'{names}{more}')

    def stepped(self, which, advance, depth):
        """The host mirrors after a tick of `which` (one Session, an index array or a slice):
        step + 1, position + advance, one more rollback slot (at most depth); a session left
        out of a fleet's tick had its ring slot rewritten unchanged (at most depth - 1)."""
        counters = self.counters
        if len(self._records) > 1:
            rollback = counters[:, Session.ROLLBACK]
            np.minimum(rollback, depth - 1, out=rollback)
        if isinstance(which, Session):      # one session (a plain Session: the latency path)
            which.step_index += 1
            which.position += advance
            which.rollback_available = min(which.rollback_available + 1, depth)
            return
        counters[which, Session.STEP] += 1
        if advance:
            counters[which, Session.POSITION] += advance
        counters[which, Session.ROLLBACK] = np.minimum(counters[which, Session.ROLLBACK] + 1,
                                                       depth)
