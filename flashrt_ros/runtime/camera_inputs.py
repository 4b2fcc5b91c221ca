"""A LeRobot policy's observation assembled where it runs, from what robots publish: camera
frames as uint8, the joint state, the instruction's tokens (the policy node's
observation_type 'cameras'; no rclpy here).

The observation vector (lerobot_chunk.py) holds each camera's image as float32 3 x H x W in
[0, 1], four times the bytes of the camera's uint8 frame. Here a frame goes to the engine's
device as it arrives, uint8, and is converted there into its place in a device-resident
observation (CameraObservation), once per frame rather than once per step; a step then adds
only the state (and Pi0.5's per-state tokens) before the engine takes the vector, on its
device, as it is. The float values are those of LeRobot's datasets (uint8 / 255 in float32,
correctly rounded): on CUDA a division by a host scalar is a multiplication by its reciprocal
(PyTorch's div_true_kernel), off by one bit for some values, so the divisor is a device
tensor. Resizing and the images' normalisation stay where LeRobot puts them, in the model's
own preprocessing inside the captured chunk; decoding a CompressedImage runs on the host
(PIL: the same pixels on every device; nvJPEG's differ).

A frame arrives in two parts, so that the slow one needs no lock: stage() converts it into a
buffer of its camera's own, apart from the vector (the node's camera thread, while a tick may
be stepping on the vector), and put_staged() then moves it into the vector in one copy (under
the node's lock, between ticks). On CUDA both are queued on the default stream, as the ticks'
graphs are: a step reads the vector as the last put left it, never half a frame.
"""
import io

import numpy as np
import torch

from .errors import InvalidObservation
from .policies.lerobot_checkpoint import observation_size

# sensor_msgs/Image encodings read: (channels, whether the channels are BGR). A simulator's
# camera often gives rgba8 / bgra8: the alpha channel is dropped, as cv_bridge's conversion
# to rgb8 drops it and as a CompressedImage's PNG with alpha reads (PIL's convert('RGB')).
ENCODINGS = {'rgb8': (3, False), 'bgr8': (3, True), 'rgba8': (4, False), 'bgra8': (4, True),
             'mono8': (1, False)}


def raw_pixels(encoding, height, width, step, data):
    """A sensor_msgs/Image's fields -> uint8 [H, W, 3] RGB; InvalidObservation for an
    encoding it does not read or data shorter than height x step."""
    if encoding not in ENCODINGS:
        raise InvalidObservation(f'encoding {encoding!r} (rgb8, bgr8, rgba8, bgra8 or mono8)')
    channels, bgr = ENCODINGS[encoding]
    data = np.frombuffer(data, np.uint8)
    if step < width * channels or data.size < height * step:
        raise InvalidObservation(f'an image of {data.size} bytes, step {step}, for {height} x '
                                 f'{width} {encoding}')
    rows = data[:height * step].reshape(height, step)
    pixels = rows[:, :width * channels].reshape(height, width, channels)
    if channels == 1:
        return np.repeat(pixels, 3, axis=2)
    return pixels[..., 2::-1] if bgr else pixels[..., :3]


def compressed_pixels(data, size=None, msg_format=''):
    """A sensor_msgs/CompressedImage's data (JPEG, PNG...) -> uint8 [H, W, 3] RGB. size: the
    (height, width) it must have, read from its header and refused (InvalidObservation)
    before anything is decoded: a frame of another size costs no decode, however large.
    msg_format: the message's format field, to name what is refused."""
    from PIL import Image, UnidentifiedImageError
    if 'compresseddepth' in msg_format.lower():
        # image_transport's depth plugin: a header, then 16-bit or float depth as PNG / RVL
        raise InvalidObservation(f'a compressedDepth image ({msg_format!r}: a depth camera\'s); '
                                 'the policy takes 8-bit colour or grey')
    try:
        image = Image.open(io.BytesIO(data))
        if size is not None and image.size != (size[1], size[0]):
            raise InvalidObservation(f'{image.size[0]} x {image.size[1]}, the checkpoint takes '
                                     f'{size[1]} x {size[0]}')
        if image.mode.startswith(('I', 'F')):
            # 16- or 32-bit greys (a depth camera's PNG): PIL's RGB conversion clips them at
            # 255, an image of another world
            raise InvalidObservation(f'a {image.mode} image (more than 8 bits a pixel: a depth '
                                     'image?); the policy takes 8-bit colour or grey')
        bits = data[24] if image.format == 'PNG' else \
            max(image.tag_v2.get(258, (8,))) if image.format == 'TIFF' else 8
        if bits > 8:
            # 16-bit colour (image_transport's png or tiff of rgb16): PIL opens it as 8-bit
            # RGB, keeping each sample's high byte; the PNG's IHDR chunk, the TIFF's
            # BitsPerSample tag tell
            raise InvalidObservation(f'a {bits}-bit {image.mode} {image.format} (more than 8 '
                                     'bits a sample); the policy takes 8-bit colour or grey')
        pixels = np.asarray(image.convert('RGB'))
        return pixels[..., ::-1] if _encoded_as_rgb(msg_format) else pixels
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise InvalidObservation(f'a compressed image PIL cannot decode: {exc}') from exc


def _encoded_as_rgb(msg_format):
    """Whether image_transport's format ('<encoding>; <codec> compressed [<encoding it was
    encoded in>]') says OpenCV encoded the image with its channels in RGB order. OpenCV
    writes a colour image as if it were BGR, so the file then holds red as blue: its tiff
    codec encodes the image as it comes ('rgb8; tiff compressed '), its jpeg and png convert
    it to bgr8 first ('rgb8; jpeg compressed bgr8'). A format without ';' (a PIL or other
    encoder's 'jpeg', 'png') says nothing of the kind: the file's colours are its own."""
    source, split, codec = msg_format.partition(';')
    words = codec.lower().split()
    if not split or 'compressed' not in words:
        return False
    after = words[words.index('compressed') + 1:]
    return (after[0] if after else source.strip().lower()).startswith('rgb')


def as_floats(pixels):
    """uint8 [H, W, 3] -> float32 [3, H, W] in [0, 1], on the host, as LeRobot's datasets
    give images (the values CameraObservation writes on the device)."""
    return np.ascontiguousarray(pixels.transpose(2, 0, 1)).astype(np.float32) / np.float32(255)


class CameraObservation:
    """One session's observation vector [obs_dim] on `device`, in the layout of
    LeRobotChunkPolicy: state, each camera (cameras: {key: (3, H, W)} in the policy's order),
    the instruction's token ids and mask (tokens of each). Each part is written when it
    arrives; `vector` is what the engine steps on (given: a fleet's row of one device tensor,
    [sessions, obs_dim], that the engine steps on at once)."""

    def __init__(self, state_dim, cameras, tokens, device, vector=None):
        self.cameras, self.tokens = dict(cameras), int(tokens)
        size = observation_size(state_dim, self.cameras, tokens)
        self.vector = torch.zeros(size, dtype=torch.float32, device=device) \
            if vector is None else vector
        assert self.vector.shape == (size,), (self.vector.shape, size)
        self._state = self.vector[:state_dim]
        self._images, at = {}, state_dim
        for key, (c, h, w) in self.cameras.items():
            self._images[key] = self.vector[at:at + c * h * w].view(c, h, w)
            at += c * h * w
        self._tokens = self.vector[at:]
        self._255 = torch.tensor(255.0, device=device)  # a device divisor: a true division
        self.has = set()            # the parts written so far: 'state', camera keys, 'tokens'
        # forget_images' count: a frame staged from a message taken before the images were
        # forgotten is the replaced episode's, and never enters the vector (put_staged)
        self.epoch = 0
        self._staged_epoch = {}
        # each camera's staged frame: uint8 as it came, then float32 as the vector holds it
        self._staged = {key: (torch.empty(h, w, c, dtype=torch.uint8, device=device),
                              torch.empty(c, h, w, device=device))
                        for key, (c, h, w) in self.cameras.items()}

    def stage(self, key, pixels, epoch=None):
        """A camera's uint8 [H, W, 3] frame, copied to the device as uint8 and converted there
        into the camera's staging buffer; the vector is not touched (put_staged). One thread
        stages. InvalidObservation (nothing written) for another size. epoch: self.epoch when
        the frame's message was taken (before its decoding), now by default."""
        raw, floats = self._staged[key]
        if pixels.shape != raw.shape:
            raise InvalidObservation(f'{pixels.shape[1]} x {pixels.shape[0]}, the checkpoint '
                                     f'takes {raw.shape[1]} x {raw.shape[0]}')
        if not pixels.flags.writeable:      # (PIL's, a message's bytes): torch warns
            pixels = pixels.copy()
        raw.copy_(torch.from_numpy(np.ascontiguousarray(pixels)))
        floats.copy_(raw.permute(2, 0, 1))
        floats.div_(self._255)
        self._staged_epoch[key] = self.epoch if epoch is None else epoch

    def put_staged(self, key):
        """The camera's staged frame into its place in the vector (one copy): True; False,
        nothing written, for a frame whose message was taken before forget_images (a restore
        while it was decoding: the replaced episode's frame)."""
        if self._staged_epoch.get(key) != self.epoch:
            return False
        self._images[key].copy_(self._staged[key][1])
        self.has.add(key)
        return True

    def put_image(self, key, pixels):
        """stage() then put_staged(), for one thread that does both."""
        self.stage(key, pixels)
        return self.put_staged(key)

    def image(self, key):
        """The camera's image as the policy takes it, float32 [3, H, W] on the device."""
        return self._images[key]

    def put_state(self, state):
        self._state.copy_(torch.from_numpy(np.asarray(state, dtype=np.float32)))
        self.has.add('state')

    def put_tokens(self, ids, mask):
        both = np.concatenate([ids, mask]).astype(np.float32)
        self._tokens.copy_(torch.from_numpy(both))
        self.has.add('tokens')

    def forget_images(self):
        """Every camera's image is stale (a simulated world replaced with the policy's state):
        missing() names them until frames taken after this come; the vector is not
        touched."""
        self.has -= set(self.cameras)
        self.epoch += 1

    def missing(self):
        """The parts not written yet (sorted names); [] once the vector is whole."""
        want = {'state', *self.cameras, *(('tokens',) if self.tokens else ())}
        return sorted(want - self.has)
