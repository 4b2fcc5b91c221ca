"""vla_inputs: cameras, joint states and an instruction as robots publish them, packed into the
observation a LeRobot policy node takes (policy_type smolvla, pi0, pi05; act and diffusion
take no instruction).

Subscribes to one sensor_msgs/Image or CompressedImage topic per camera of the checkpoint
(`camera_topics`: 'feature_key=topic', e.g. 'observation.images.top=/camera/top/image_raw';
the message type is `camera_types`' entry, 'raw' or 'compressed'), to sensor_msgs/JointState
(`joint_names`: the state's order) and to std_msgs/String on ~/instruction (also the
`instruction` parameter). Each joint state, once every camera has an image and there is an
instruction, becomes one observation on `<policy>/observation`: the state, each camera's image
as 3 x H x W in [0, 1] (uint8 / 255, as LeRobot's datasets give them), and the instruction's
token ids and attention mask from the checkpoint's own pre-processor (its tokenizer, the
newline SmolVLA appends, padding to the checkpoint's length). Pi0.5's prompt holds the state
(its pre-processor normalises and discretises it into the text): its tokens are made anew for
every joint state, from that state, so that they belong to the observation. A camera image of
another size than the checkpoint's, an encoding other than rgb8 / bgr8 / mono8, or a joint
state without one of joint_names is refused with a warning and counted; nothing is published
for it.
"""
import array
import io

import numpy as np
import rclpy
from rclpy.node import Node
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float32MultiArray, String

from flashrt_ros.executors import publisher_events, run

CHANNELS = {'rgb8': (3, False), 'bgr8': (3, True), 'mono8': (1, False)}


def image_array(msg):
    """sensor_msgs Image or CompressedImage -> float32 [3, H, W] in [0, 1]; ValueError for
    an encoding it cannot read."""
    if isinstance(msg, CompressedImage):
        from PIL import Image as PILImage
        pixels = np.asarray(PILImage.open(io.BytesIO(bytes(msg.data))).convert('RGB'))
    else:
        if msg.encoding not in CHANNELS:
            raise ValueError(f'encoding {msg.encoding!r} (rgb8, bgr8 or mono8)')
        channels, bgr = CHANNELS[msg.encoding]
        rows = np.frombuffer(bytes(msg.data), np.uint8).reshape(msg.height, msg.step)
        pixels = rows[:, :msg.width * channels].reshape(msg.height, msg.width, channels)
        pixels = pixels[..., ::-1] if bgr else np.repeat(pixels, 3 // channels, axis=2)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)).astype(np.float32) / \
        np.float32(255)


class VLAInputs(Node):
    """The bridge; checkpoint: a LeRobot checkpoint folder (the policy node's policy_file)."""

    def __init__(self, name='vla_inputs', **kwargs):
        super().__init__(name, **kwargs)
        p = {k: self.declare_parameter(k, v).value for k, v in (
            ('checkpoint', ''), ('policy', '/flashrt_policy'), ('camera_topics', ['']),
            ('camera_types', ['']), ('joint_names', ['']),
            ('joint_state_topic', '/joint_states'), ('instruction', ''))}
        from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
        self.cameras, self.tokens, self._tokenize = checkpoint_inputs(p['checkpoint'])
        # Pi0.5: the prompt holds the state, so every observation is tokenized with its own
        # (tokens made once per instruction would carry a stale state: every action wrong)
        self._per_state = self._tokenize is not None and self._tokenize.state_in_prompt
        topics = dict(t.split('=', 1) for t in p['camera_topics'] if t)
        missing = sorted(set(self.cameras) - set(topics))
        if missing:
            raise ValueError(f'camera_topics names no topic for {missing}')
        kinds = [k for k in p['camera_types'] if k] or ['raw'] * len(topics)
        self.joints = [j for j in p['joint_names'] if j]
        self.images, self.refused = {}, 0
        self.text = None                # the instruction as given
        self.instruction = None if self.tokens else ()     # its tokens; (): the policy takes none
        if p['instruction']:
            self._on_instruction(String(data=p['instruction']))
        self.pub = self.create_publisher(Float32MultiArray, f'{p["policy"]}/observation', 10,
                                         event_callbacks=publisher_events())
        for (key, topic), kind in zip(sorted(topics.items()), kinds):
            msg_type = CompressedImage if kind == 'compressed' else Image
            self.create_subscription(msg_type, topic,
                                     lambda m, key=key: self._on_image(key, m), 10)
        self.create_subscription(String, '~/instruction', self._on_instruction, 10)
        self.create_subscription(JointState, p['joint_state_topic'], self._on_joints, 10)

    def _refuse(self, what):
        self.refused += 1
        self.get_logger().warning(f'refused: {what}', throttle_duration_sec=1.0)

    def _on_image(self, key, msg):
        try:
            image = image_array(msg)
        except ValueError as exc:
            return self._refuse(f'{key}: {exc}')
        if image.shape != self.cameras[key]:
            return self._refuse(f'{key} is {image.shape}, the checkpoint takes '
                                f'{self.cameras[key]}')
        self.images[key] = image

    def _on_instruction(self, msg):
        if self._tokenize is None:
            return self._refuse('an instruction: this checkpoint takes none')
        self.text = msg.data
        if not self._per_state:
            self.instruction = self._tokenize(msg.data)

    def _on_joints(self, msg):
        where = {n: i for i, n in enumerate(msg.name)}
        if any(j not in where for j in self.joints) or len(msg.position) != len(msg.name):
            return self._refuse(f'joint state without {self.joints}')
        if (self.text is None and self.tokens) or len(self.images) < len(self.cameras):
            return      # not everything has come yet
        state = np.array([msg.position[where[j]] for j in self.joints], np.float32)
        instruction = self._tokenize(self.text, state) if self._per_state else self.instruction
        out = Float32MultiArray()
        out.data = array.array('f', np.concatenate(     # every part float32 already
            [state, *[self.images[k].ravel() for k in self.cameras], *instruction]
        ).tobytes())
        self.pub.publish(out)


def main(args=None):
    rclpy.init(args=args)
    run(VLAInputs())
