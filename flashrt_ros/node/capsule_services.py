"""The policy node's capsule services (flashrt_ros/interfaces.py names them and their
types): each ~/<name> request becomes one PolicyEngine operation.

Services exist in every lifecycle state, so that a call made while the node is not active
gets a clear refusal instead of silence. Each runs under the node's lock (a transition never
clears the engine under an operation, and no control tick interleaves with one); a refusal
(FlashRTError) answers success=False with the reason, and any other failure answers
'internal error: ...' rather than crashing the node. After an operation that replaces a
session's state, its guard and the control loop follow (restore and reset end a poison hold;
a rollback does not).
"""
from flashrt_ros.interfaces import SERVICE_TYPES
from flashrt_ros.messages import capsule_info
from flashrt_ros.runtime.errors import FlashRTError


class CapsuleServices:
    """create_service: the node's; current() -> the configure's parts (`engine`, `guards`,
    `loop`) or None; state() -> the lifecycle state's name; lock: the node's lock."""

    def __init__(self, name, logger, lock, current, state, create_service, group):
        self._name, self.log, self._lock = name, logger, lock
        self._current, self._state = current, state
        for service, srv_type in SERVICE_TYPES.items():
            create_service(srv_type, '~/' + service, getattr(self, service),
                           callback_group=group)

    def _serve(self, response, operation):
        """Runs operation(parts) while active; refusals become success=False."""
        with self._lock:
            parts = self._current()
            if parts is None or self._state() != 'active':
                state = self._state()
                response.success = False
                response.message = f'node {self._name!r} is {state}, not active: ' + (
                    'a finalized node cannot be activated again; restart it'
                    if state == 'finalized' else
                    'activate it before calling capsule services')
                return response
            try:
                operation(parts)
                response.success = True
            except FlashRTError as exc:
                response.success = False
                response.message = str(exc)
            except Exception as exc:  # noqa: B902 - a service must answer, never crash the node
                self.log.error(f'capsule service failed: {exc!r}')
                response.success = False
                response.message = f'internal error: {exc!r}'
            return response

    @staticmethod
    def _answer(response, result):
        """Fills the response fields the operation's OpResult has."""
        response.message = result.message
        if hasattr(response, 'capsule'):
            response.capsule = capsule_info(result.manifest)
        if hasattr(response, 'latency_us'):
            response.latency_us = float(result.latency_us)

    @staticmethod
    def _replaced(parts, index, restored=True):
        """Session `index`'s state was replaced: a restore or reset ends its poison hold."""
        if restored:
            parts.guards[index].state_replaced()
        parts.loop.state_replaced(index)

    def snapshot(self, request, response):
        return self._serve(response, lambda p: self._answer(response, p.engine.snapshot(
            request.name, overwrite=request.overwrite, pin=request.pin,
            session=request.session)))

    def restore(self, request, response):
        kinds = list(request.kinds) or None

        def op(p):
            index = p.engine.session(request.session).index
            self._answer(response, p.engine.restore(request.name, kinds, session=index))
            if kinds is None:       # a partial restore leaves the rest, a hold included
                self._replaced(p, index)
            elif 'chunk' in kinds:  # but a chunk restored is owed (~/action_chunk)
                p.loop.sessions[index].chunk_owed = True
        return self._serve(response, op)

    def fork(self, request, response):
        # the session matters only when forking the live state (source '')
        return self._serve(response, lambda p: self._answer(response, p.engine.fork(
            request.source, request.target, overwrite=request.overwrite,
            session=request.session if not request.source else 0)))

    def rollback(self, request, response):
        def op(p):
            index = p.engine.session(request.session).index
            result = p.engine.rollback(int(request.steps), session=index)
            self._answer(response, result)
            response.step = result.step
            self._replaced(p, index, restored=False)
        return self._serve(response, op)

    def list_capsules(self, request, response):
        with self._lock:
            parts = self._current()
            if parts is None:
                return response       # unconfigured: no store, nothing to list
            store = parts.engine.store
            response.capsules = [capsule_info(m) for m in store.list()]
            response.device_bytes_used = store.device_bytes_used
            response.device_bytes_budget = store.device_budget
            response.host_bytes_used = store.host_bytes_used
            response.host_bytes_budget = store.host_budget
            return response

    def delete_capsule(self, request, response):
        return self._serve(response, lambda p: self._answer(response,
                                                            p.engine.delete(request.name)))

    def save_capsule(self, request, response):
        def op(p):
            result = p.engine.save(request.name, request.path)
            self._answer(response, result)
            response.path = result.path
            response.nbytes = result.manifest.nbytes
        return self._serve(response, op)

    def load_capsule(self, request, response):
        return self._serve(response, lambda p: self._answer(response, p.engine.load(
            request.path, request.name, overwrite=request.overwrite)))

    def reset_episode(self, request, response):
        """A new episode in every session (a fleet's reset between episodes)."""
        def op(p):
            results = [p.engine.reset_episode(session=i) for i in range(p.engine.sessions)]
            for i in range(p.engine.sessions):
                self._replaced(p, i)
            response.message = results[0].message if len(results) == 1 else \
                f'{len(results)} sessions: {results[0].message}; ...; {results[-1].message}'
        return self._serve(response, op)

    def reset_session(self, request, response):
        def op(p):
            index = p.engine.session(request.session).index
            self._answer(response, p.engine.reset_episode(session=index))
            self._replaced(p, index)
        return self._serve(response, op)

    def recover(self, request, response):
        """Restores the newest checkpoint that passes validation (finite bytes), else
        episode_start: in the held sessions when any is held (the others run on untouched),
        else in every session (std_srvs/Trigger carries no session field)."""
        def op(p):
            guards = [g for g in p.guards if g.held] or p.guards
            response.message = '; '.join(g.recover() for g in guards)
        return self._serve(response, op)
