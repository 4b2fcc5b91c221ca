"""The policy node's service table: ~/<name> of type SERVICE_TYPES[name].

One table for the server (flashrt_ros/node/capsule_services.py serves each name) and the
client (flashrt_ros/client.py calls them), so the two cannot drift apart.
"""
from std_srvs.srv import Trigger

from flashrt_ros import srv as fsrv

SERVICE_TYPES = {
    'snapshot': fsrv.Snapshot,
    'restore': fsrv.Restore,
    'fork': fsrv.Fork,
    'rollback': fsrv.Rollback,
    'list_capsules': fsrv.ListCapsules,
    'delete_capsule': fsrv.DeleteCapsule,
    'save_capsule': fsrv.SaveCapsule,
    'load_capsule': fsrv.LoadCapsule,
    'reset_episode': Trigger,
    'reset_session': fsrv.ResetSession,
    'recover': Trigger,
}
