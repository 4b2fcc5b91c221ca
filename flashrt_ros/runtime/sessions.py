"""Sessions: the independent policy states of one engine, one record each, addressed by index
or name."""

from dataclasses import dataclass, field

from .errors import InvalidConfig


@dataclass
class Session:
    """One session: its views of the arena, and host mirrors of its counters and lineage (the
    device holds the truth in meta; these follow it deterministically from what each operation
    did)."""
    index: int
    name: str
    views: dict = field(repr=False, compare=False)   # its typed arena views, meta included
    step_index: int = 0
    episode: int = 0
    position: int = 0
    rollback_available: int = 0
    lineage: str = ''       # the capsule the live state descends from (manifest.parent)


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
        self._records = [Session(i, n, views)
                         for i, (n, views) in enumerate(zip(names, arena.session_views))]
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
