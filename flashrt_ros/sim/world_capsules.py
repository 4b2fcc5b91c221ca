"""World capsules: the `flashrt_sim` node's named world states, in memory and in files.

A world capsule is a MujocoSnapshots snapshot (world.py: the complete integration state,
mjSTATE_INTEGRATION, plus the step counter, observation noise and the world's own held
state), so a restore continues bit for bit. The rules are the policy capsules': names from
[A-Za-z0-9_.-] (check_name; the checkpoint-* names are reserved), an existing name is replaced
only with overwrite, files live under the capsule directory in the checksummed capsule format
(capsule_file.py) with a schema digest (the world's class and state layout) and a model digest
(the compiled MuJoCo model), and a file made by another model or by a policy is refused.
World capsules live on the host (tier 'host'): the physics state is CPU memory.
"""
import hashlib
import time

import numpy as np
import torch

from flashrt_ros import srv as fsrv
from flashrt_ros.msg import CapsuleInfo
from flashrt_ros.runtime.capsule_file import Manifest, read_file, write_file
from flashrt_ros.runtime.capsule_names import CapsuleNames
from flashrt_ros.runtime.enums import Tier
from flashrt_ros.runtime.errors import (
    CapsuleExists, FlashRTError, IncompatibleCapsule, UnknownCapsule)
from flashrt_ros.sim.world import mujoco


def model_digest(model):
    """sha256 of the compiled model (MuJoCo's binary model file)."""
    buffer = np.zeros(mujoco.mj_sizeModel(model), dtype=np.uint8)
    mujoco.mj_saveModel(model, None, buffer)
    return hashlib.sha256(buffer.tobytes()).hexdigest()


class WorldCapsules:
    """Named world states of one MujocoSnapshots world, and their files in `directory`."""

    def __init__(self, world, directory):
        self.world = world
        self.names = CapsuleNames(directory)
        self.model_digest = model_digest(world.model)

    def _known(self, name):
        if name not in self.world.snapshots:
            raise UnknownCapsule(f'no world capsule named {name!r} (have: '
                                 f'{", ".join(sorted(self.world.snapshots)) or "none"})')

    def _new(self, name, overwrite):
        self.names.validate(name)
        if name in self.world.snapshots and not overwrite:
            raise CapsuleExists(f'world capsule {name!r} exists: set overwrite to replace it')

    def snapshot(self, name, overwrite=False):
        """Keeps the world's state as `name`; returns its physics state's bytes."""
        self._new(name, overwrite)
        return self.world.snapshot(name)

    def restore(self, name):
        self._known(name)
        return self.world.restore(name)

    def delete(self, name):
        self._known(name)
        self.world.delete(name)

    def list(self):
        """(name, step counter, bytes) of every world capsule, by name."""
        return [(name, kept[1], kept[0].nbytes)
                for name, kept in sorted(self.world.snapshots.items())]

    def save(self, name, path=''):
        """Writes capsule `name` to its file (path: under the capsule directory; default
        <name>.capsule); returns (path, bytes)."""
        self._known(name)
        full = self.names.save_path(name, path)
        blob = self.world.snapshot_bytes(name)
        manifest = Manifest(name=name, parent='', tier=Tier.HOST, pinned=False,
                            step=int(self.world.snapshots[name][1]), episode=0, position=0,
                            nbytes=len(blob), schema_digest=self.world.state_digest(),
                            model_digest=self.model_digest, created=time.time())
        write_file(full, manifest, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        return full, len(blob)

    def load(self, path, name='', overwrite=False):
        """Reads a world capsule file (checksum, schema and model checked) and keeps it as
        `name` (default: the name in the file); returns (name, step counter, bytes)."""
        full = self.names.load_path(path)
        manifest, data = read_file(full)
        if manifest.schema_digest != self.world.state_digest() or \
                manifest.model_digest != self.model_digest:
            raise IncompatibleCapsule(
                f'{full!r} is not a world capsule of this model (schema '
                f'{manifest.schema_digest[:60]!r}, here {self.world.state_digest()[:60]!r}; '
                'model digests ' + ('equal' if manifest.model_digest == self.model_digest
                                    else 'differ') + ')')
        name = name or manifest.name
        self._new(name, overwrite)
        self.world.load_snapshot_bytes(name, data.numpy().tobytes())
        return name, manifest.step, manifest.nbytes


class CapsuleServices:
    """SimNode's world capsule services (a mixin): ~/snapshot, ~/restore, ~/save_capsule,
    ~/load_capsule, ~/list_capsules, ~/delete_capsule, with this package's capsule service
    types. The node provides capsules (WorldCapsules), world, lock, busy and changed()."""

    def serve_capsules(self, group):
        for name, srv_type, callback in (
                ('snapshot', fsrv.Snapshot, self.snapshot_callback),
                ('restore', fsrv.Restore, self.restore_callback),
                ('save_capsule', fsrv.SaveCapsule, self.save_callback),
                ('load_capsule', fsrv.LoadCapsule, self.load_callback),
                ('list_capsules', fsrv.ListCapsules, self.list_callback),
                ('delete_capsule', fsrv.DeleteCapsule, self.delete_callback)):
            self.create_service(srv_type, f'~/{name}', callback, callback_group=group)

    def snapshot_callback(self, request, response):
        t0 = time.perf_counter()
        with self.lock:
            try:
                nbytes = self.capsules.snapshot(request.name, request.overwrite)
            except (FlashRTError, ValueError) as exc:
                response.success, response.message = False, str(exc)
                return response
            steps = self.world.steps
        self._fill_response(response, request.name, steps, nbytes, t0)
        response.message = f'world snapshot {request.name!r} at step {steps}'
        return response

    def restore_callback(self, request, response):
        t0 = time.perf_counter()
        if self.busy:
            response.success, response.message = False, f'{self.busy} is running'
            return response
        with self.lock:
            try:
                obs = self.capsules.restore(request.name)
            except FlashRTError as exc:
                response.success, response.message = False, str(exc)
                return response
            steps = self.world.steps
            self.changed(obs)
        self._fill_response(response, request.name, steps, self.world.state_size * 8, t0)
        response.message = f'world restored to {request.name!r} (step {steps})'
        return response

    def save_callback(self, request, response):
        with self.lock:
            try:
                response.path, response.nbytes = self.capsules.save(request.name, request.path)
            except FlashRTError as exc:
                response.success, response.message = False, str(exc)
                return response
        response.success, response.message = True, f'world capsule saved to {response.path}'
        return response

    def load_callback(self, request, response):
        with self.lock:
            try:
                name, steps, nbytes = self.capsules.load(request.path, request.name,
                                                         request.overwrite)
            except FlashRTError as exc:
                response.success, response.message = False, str(exc)
                return response
        self._fill_response(response, name, steps, nbytes, time.perf_counter())
        response.message = f'world capsule {name!r} loaded (restore it to use it)'
        return response

    def list_callback(self, request, response):
        with self.lock:
            for name, steps, nbytes in self.capsules.list():
                info = CapsuleInfo(name=name, tier='host', step=int(steps), nbytes=int(nbytes))
                response.capsules.append(info)
                response.host_bytes_used += int(nbytes)
        return response

    def delete_callback(self, request, response):
        with self.lock:
            try:
                self.capsules.delete(request.name)
            except FlashRTError as exc:
                response.success, response.message = False, str(exc)
                return response
        response.success, response.message = True, f'world capsule {request.name!r} deleted'
        return response

    def _fill_response(self, response, name, steps, nbytes, t0):
        response.success = True
        if hasattr(response, 'latency_us'):
            response.latency_us = (time.perf_counter() - t0) * 1e6
        response.capsule.name = name
        response.capsule.tier = 'host'
        response.capsule.step = int(steps)
        response.capsule.nbytes = int(nbytes)
        response.capsule.stamp = self.get_clock().now().to_msg()
