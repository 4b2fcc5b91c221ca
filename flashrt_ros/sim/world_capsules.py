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

from flashrt_ros.runtime.capsule_file import Manifest, read_file, write_file
from flashrt_ros.runtime.capsule_names import CapsuleNames
from flashrt_ros.runtime.enums import Tier
from flashrt_ros.runtime.errors import CapsuleExists, IncompatibleCapsule, UnknownCapsule
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
