"""Where the test assets are: the repository root, its config/g1.yaml, the Unitree G1 folder
beside the repository (../shared/robots/unitree_g1; a user's fresh clone has none) and the skip
mark of the tests that need it. No ROS, no torch."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
G1 = ROOT.parent / 'shared' / 'robots' / 'unitree_g1'
G1_YAML = ROOT / 'config' / 'g1.yaml'
NEEDS_G1 = pytest.mark.skipif(not (G1 / 'motion.pt').exists(),
                              reason=f'needs the Unitree G1 assets in {G1} (../shared, '
                              'absent in a fresh clone)')
