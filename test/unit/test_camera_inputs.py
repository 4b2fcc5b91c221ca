"""A LeRobot policy's observation assembled on the engine's device from camera frames
(runtime/camera_inputs.py): the pixels of each sensor_msgs encoding read, a frame's float
values exactly LeRobot's datasets' (uint8 / 255 in float32) on the CPU and on CUDA, what
cannot be read refused with nothing written, and a SmolVLA stepped on the device-assembled
vector acting bit for bit as on the host-packed one, frames staged on another thread too.
"""
import io
import struct

import numpy as np
import pytest
import torch

from flashrt_ros.runtime.camera_inputs import (as_floats, CameraObservation,
                                               compressed_pixels, raw_pixels)
from flashrt_ros.runtime.errors import InvalidObservation

DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)]
CAMERAS = {'observation.images.top': (3, 48, 64), 'observation.images.wrist': (3, 32, 32)}


def _frame(rng, h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_each_encoding_reads_as_rgb():
    rng = np.random.default_rng(0)
    rgb = _frame(rng, 5, 7)
    assert np.array_equal(raw_pixels('rgb8', 5, 7, 21, rgb.tobytes()), rgb)
    assert np.array_equal(raw_pixels('bgr8', 5, 7, 21, rgb[..., ::-1].tobytes()), rgb)
    # rows padded to a step wider than the image (a driver's alignment)
    padded = np.concatenate([rgb.reshape(5, 21), np.full((5, 3), 77, np.uint8)], axis=1)
    assert np.array_equal(raw_pixels('rgb8', 5, 7, 24, padded.tobytes()), rgb)
    # a simulator's camera with alpha (the alpha dropped, whatever it holds)
    alpha = rng.integers(0, 256, (5, 7, 1), dtype=np.uint8)
    rgba = np.concatenate([rgb, alpha], axis=2)
    assert np.array_equal(raw_pixels('rgba8', 5, 7, 28, rgba.tobytes()), rgb)
    bgra = np.concatenate([rgb[..., ::-1], alpha], axis=2)
    assert np.array_equal(raw_pixels('bgra8', 5, 7, 28, bgra.tobytes()), rgb)
    grey = rgb[..., 0]
    assert np.array_equal(raw_pixels('mono8', 5, 7, 7, grey.tobytes()),
                          np.repeat(grey[..., None], 3, axis=2))
    png = io.BytesIO()
    from PIL import Image
    Image.fromarray(rgb).save(png, format='PNG')
    assert np.array_equal(compressed_pixels(png.getvalue()), rgb)
    assert np.array_equal(compressed_pixels(png.getvalue(), (5, 7)), rgb)


def test_a_compressed_frame_of_another_size_is_refused_before_it_is_decoded(monkeypatch):
    """The size comes from the header: a frame too large (here 4000 x 3000) is refused
    without decoding it (PIL's decoder is not called)."""
    from PIL import Image, ImageFile
    big = io.BytesIO()
    Image.new('RGB', (4000, 3000)).save(big, format='JPEG')
    decoded = []
    real = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, 'load',
                        lambda self: decoded.append(self.size) or real(self))
    with pytest.raises(InvalidObservation, match='4000 x 3000, the checkpoint takes 64 x 48'):
        compressed_pixels(big.getvalue(), (48, 64))
    assert decoded == []
    assert compressed_pixels(big.getvalue()).shape == (3000, 4000, 3) and decoded


@pytest.mark.parametrize('bad, words', [
    (('yuv422', 5, 7, 14, bytes(70)), 'yuv422'),
    (('rgb8', 5, 7, 21, bytes(21 * 4)), '84 bytes'),          # a truncated image
    (('rgb8', 5, 7, 20, bytes(100)), 'step 20'),              # a step shorter than a row
    (('rgba8', 5, 7, 21, bytes(105)), 'step 21'),             # rgb8's step, called rgba8
    (('rgb16', 5, 7, 42, bytes(210)), 'rgb16')])              # 16 bits a sample
def test_what_cannot_be_read_is_refused(bad, words):
    with pytest.raises(InvalidObservation, match=words):
        raw_pixels(*bad)
    with pytest.raises(InvalidObservation, match='cannot decode'):
        compressed_pixels(b'not an image')
    # a depth camera's image_transport topic: named, not "cannot decode"
    with pytest.raises(InvalidObservation, match="compressedDepth image .'16UC1; "
                                                 "compressedDepth png'"):
        compressed_pixels(bytes(12) + b'\x89PNG', None, '16UC1; compressedDepth png')


def test_a_16_bit_png_is_refused_not_clipped():
    """A depth camera's 16-bit grey PNG on a CompressedImage topic: PIL's RGB conversion
    would clip it at 255 (an image of another world); refused, and so is a 16-bit colour
    PNG, which PIL would cut to its high bytes. An 8-bit grey PNG reads as grey RGB."""
    from PIL import Image
    depth = (np.arange(48 * 64).reshape(48, 64) * 20).astype(np.uint16)     # up to 61,420
    png = io.BytesIO()
    Image.fromarray(depth).save(png, format='PNG')
    assert Image.open(io.BytesIO(png.getvalue())).mode.startswith('I')
    with pytest.raises(InvalidObservation, match='I;16 image .more than 8 bits'):
        compressed_pixels(png.getvalue(), (48, 64))
    # 16-bit colour and colour with alpha (image_transport's png of rgb16 / rgba16): PIL
    # opens them as RGB / RGBA, each sample's high byte (1000 -> 3)
    import png as pypng
    for planes in (3, 4):
        colour = np.full((48, 64 * planes), 1000, np.uint16)
        written = io.BytesIO()
        pypng.Writer(64, 48, greyscale=False, alpha=planes == 4, bitdepth=16).write(
            written, colour)
        assert Image.open(io.BytesIO(written.getvalue())).mode in ('RGB', 'RGBA')
        with pytest.raises(InvalidObservation, match='16-bit RGBA? PNG .more than 8 bits'):
            compressed_pixels(written.getvalue(), (48, 64))
    grey = io.BytesIO()
    Image.fromarray((depth >> 8).astype(np.uint8)).save(grey, format='PNG')
    pixels = compressed_pixels(grey.getvalue(), (48, 64))
    assert pixels.shape == (48, 64, 3) and np.array_equal(pixels[..., 2], depth >> 8)


def _tiff_16_bit_rgb(value, height, width):
    """An uncompressed 16-bit RGB TIFF (what OpenCV's imencode writes for an rgb16 image;
    PIL writes no such file): header, BitsPerSample, pixels, one IFD."""
    pixels = np.full((height, width, 3), value, '<u2').tobytes()
    at = 14 + len(pixels)
    tags = [(256, 3, 1, width), (257, 3, 1, height), (258, 3, 3, 8), (259, 3, 1, 1),
            (262, 3, 1, 2), (273, 4, 1, 14), (277, 3, 1, 3), (278, 3, 1, height),
            (279, 4, 1, len(pixels)), (284, 3, 1, 1)]
    ifd = struct.pack('<H', len(tags)) + b''.join(
        struct.pack('<HHI', tag, kind, count) +
        (struct.pack('<HH', value, 0) if kind == 3 and count == 1 else struct.pack('<I', value))
        for tag, kind, count, value in tags) + struct.pack('<I', 0)
    return b'II*\x00' + struct.pack('<I', at) + struct.pack('<3H', 16, 16, 16) + pixels + ifd


def test_image_transports_format_says_which_order_the_colours_were_encoded_in():
    """compressed_image_transport's tiff codec encodes the image as it comes
    (toCvShare(message, nullptr, '') in compressed_publisher.cpp) and OpenCV writes any
    colour image as BGR: an rgb8 camera's file holds its red as blue, format 'rgb8; tiff
    compressed '. Read back in RGB order, as image_transport's subscriber reads it; a bgr8
    camera's tiff, its jpeg / png (converted to bgr8 first: 'compressed bgr8') and a plain
    'png' are read as they are. A 16-bit colour TIFF is refused (PIL keeps its high bytes)."""
    from PIL import Image
    rgb = np.random.default_rng(3).integers(0, 256, (6, 8, 3), dtype=np.uint8)

    def file_of(pixels, kind):
        out = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(pixels)).save(out, format=kind)
        return out.getvalue()
    as_opencv_writes_rgb8 = file_of(rgb[..., ::-1], 'TIFF')    # the channels as the Mat's
    assert np.array_equal(compressed_pixels(as_opencv_writes_rgb8, (6, 8),
                                            'rgb8; tiff compressed '), rgb)
    assert not np.array_equal(compressed_pixels(as_opencv_writes_rgb8, (6, 8), 'tiff'), rgb)
    for msg_format, kind in (('bgr8; tiff compressed ', 'TIFF'), ('png', 'PNG'),
                             ('rgb8; png compressed bgr8', 'PNG'), ('', 'PNG'),
                             ('bgr8; png compressed bgr8', 'PNG')):
        assert np.array_equal(compressed_pixels(file_of(rgb, kind), (6, 8), msg_format), rgb)
    with pytest.raises(InvalidObservation, match='16-bit RGB TIFF .more than 8 bits'):
        compressed_pixels(_tiff_16_bit_rgb(1000, 6, 8), (6, 8), 'rgb16; tiff compressed ')


@pytest.mark.parametrize('device', DEVICES)
def test_frames_convert_on_the_device_exactly_as_lerobots_datasets(device):
    """Every uint8 value, and random frames: the device's float32 equals the host's
    uint8 / 255 bit for bit (on CUDA a host scalar divisor would be a multiplication by its
    reciprocal, off by one bit for some values). A staged frame leaves the vector as it was
    until it is put. A frame of another size is refused and leaves the last one in place."""
    rng = np.random.default_rng(1)
    obs = CameraObservation(4, CAMERAS, 3, device)
    every = np.arange(256, dtype=np.uint8).reshape(16, 16)
    top = np.tile(every, (3, 4))[:48, :64, None].repeat(3, axis=2)     # all 256 values
    for frame in [top, _frame(rng, 48, 64)]:
        obs.put_image('observation.images.top', frame)
        got = obs.image('observation.images.top').cpu().numpy()
        assert got.tobytes() == as_floats(frame).tobytes()
    wrist = _frame(rng, 32, 32)
    before = obs.vector.clone()
    obs.stage('observation.images.wrist', wrist)    # the camera thread, while a step may run
    assert torch.equal(obs.vector, before) and 'observation.images.wrist' not in obs.has
    obs.put_staged('observation.images.wrist')      # between steps, under the node's lock
    assert obs.image('observation.images.wrist').cpu().numpy().tobytes() == \
        as_floats(wrist).tobytes()
    before = obs.vector.clone()
    with pytest.raises(InvalidObservation, match='the checkpoint takes 64 x 48'):
        obs.put_image('observation.images.top', _frame(rng, 64, 48))
    assert torch.equal(obs.vector, before)
    assert obs.missing() == ['state', 'tokens']
    obs.put_state(np.arange(4, dtype=np.float32))
    obs.put_tokens(np.array([5, 6, 0], np.float32), np.array([1, 1, 0], np.float32))
    assert obs.missing() == []
    host = np.concatenate([np.arange(4, dtype=np.float32), as_floats(frame).ravel(),
                           as_floats(wrist).ravel(), [5, 6, 0, 1, 1, 0]]).astype(np.float32)
    assert obs.vector.cpu().numpy().tobytes() == host.tobytes()


def _two_engines(tmp_path, device):
    """(the checkpoint's cameras, two engines of one SmolVLA demo checkpoint, a
    CameraObservation on the second's device holding the instruction's tokens, the token ids,
    the mask); skips without lerobot."""
    pytest.importorskip('lerobot.policies.smolvla.modeling_smolvla',
                        reason='needs lerobot 0.4.4 and transformers (requirements/vla.txt)')
    from flashrt_ros.runtime.engine import PolicyEngine
    from flashrt_ros.runtime.policies.lerobot_checkpoint import checkpoint_inputs
    from flashrt_ros.runtime.policies.lerobot_smolvla import SmolVLAChunkPolicy
    from support.smolvla import checkpoint, STATE_DIM, TASKS, vlm_folder
    folder = checkpoint(vlm_folder(tmp_path / 'vlm'), tmp_path / 'checkpoint')
    cameras, tokens, tokenize = checkpoint_inputs(folder)
    engines = [PolicyEngine(SmolVLAChunkPolicy.from_pretrained(folder, seed=3), device=device,
                            capsule_dir=str(tmp_path / f'capsules{i}')) for i in range(2)]
    obs = CameraObservation(STATE_DIM, cameras, tokens, engines[1].device)
    ids, mask = tokenize(TASKS[0])
    obs.put_tokens(ids, mask)
    return cameras, engines, obs, ids, mask


@pytest.mark.parametrize('device', DEVICES)
def test_a_smolvla_acts_on_the_device_vector_as_on_the_host_one(tmp_path, device):
    """Two engines of one SmolVLA checkpoint (a captured chunk graph on CUDA): one fed the
    host-packed vectors, the other the CameraObservation's device vector filled from the
    same uint8 frames; their actions are identical over three chunks."""
    cameras, engines, obs, ids, mask = _two_engines(tmp_path, device)
    from support.smolvla import STATE_DIM
    rng = np.random.default_rng(2)
    for _ in range(3 * engines[0].policy.steps):
        state = rng.standard_normal(STATE_DIM).astype(np.float32)
        images = {k: _frame(rng, s[1], s[2]) for k, s in cameras.items()}
        for key, image in images.items():
            obs.put_image(key, image)
        obs.put_state(state)
        host = np.concatenate([state, *[as_floats(im).ravel() for im in images.values()],
                               ids, mask])
        a = engines[0].step(host)
        b = engines[1].step_all(obs.vector.view(1, -1))[0].cpu()
        assert a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize('device', DEVICES)
def test_frames_staged_while_steps_run_enter_whole_between_them(tmp_path, device):
    """The node's two threads, on a SmolVLA (a captured chunk graph on CUDA): one stages
    frames without the lock, as fast as it can, while the other steps under the lock; a
    staged frame enters between steps (put_staged under the lock). Every step's actions are
    those of a host-packed engine on the frames in place at that step, bit for bit: a step
    never sees a frame being staged, nor half of one."""
    import threading

    cameras, engines, obs, ids, mask = _two_engines(tmp_path, device)
    from support.smolvla import STATE_DIM
    rng = np.random.default_rng(6)
    pool = {k: [_frame(rng, s[1], s[2]) for _ in range(4)] for k, s in cameras.items()}
    lock, done, placed, staged = threading.Lock(), threading.Event(), {}, [0]

    def camera_thread(rng=np.random.default_rng(7)):     # a generator of its own
        while not done.is_set():
            for key, frames in pool.items():
                n = int(rng.integers(len(frames)))
                obs.stage(key, frames[n])           # no lock: a step may be running
                with lock:
                    obs.put_staged(key)
                    placed[key] = n
                staged[0] += 1
    for key, frames in pool.items():
        obs.put_image(key, frames[0])
        placed[key] = 0
    thread = threading.Thread(target=camera_thread, daemon=True)
    thread.start()
    try:
        for _ in range(3 * engines[0].policy.steps):
            state = rng.standard_normal(STATE_DIM).astype(np.float32)
            with lock:
                obs.put_state(state)
                b = engines[1].step_all(obs.vector.view(1, -1))[0].cpu()
                host = np.concatenate([state, *[as_floats(pool[k][placed[k]]).ravel()
                                                for k in cameras], ids, mask])
            a = engines[0].step(host)
            assert a.numpy().tobytes() == b.numpy().tobytes()
    finally:
        done.set()
        thread.join(30)
    assert staged[0] > 3 * engines[0].policy.steps       # frames came during the steps


def test_a_frame_taken_before_a_restore_and_decoded_across_it_is_left_out(monkeypatch):
    """Lock-step: a restore forgets the frames (the world's episode was replaced), and a
    joint state waits for new ones. A frame whose message the camera thread took before the
    restore, decoded while it ran, lands after it: it is the replaced episode's, and is left
    out (the camera still missing, the vector as it was); the next frame enters."""
    import types

    from flashrt_ros.node import camera_readings
    from flashrt_ros.node.camera_readings import CameraReadings
    from flashrt_ros.node.robot_io import SessionIO
    logged = []
    setup = types.SimpleNamespace(cameras=CAMERAS, tokens=0, tokenize=None, state_dim=2,
                                  compressed=set())
    cfg = types.SimpleNamespace(joint_names=['a', 'b'], instruction='', camera_sync='newest',
                                joint_offset=[], joint_scale=[], max_input_age=0.1)
    readings = CameraReadings(setup, cfg, 'cpu', None, types.SimpleNamespace(info=logged.append))
    s = SessionIO(0, 'robot', '~/', '', '')
    rng, key = np.random.default_rng(9), 'observation.images.wrist'

    def message(pixels):
        h, w, _ = pixels.shape
        return types.SimpleNamespace(encoding='rgb8', height=h, width=w, step=3 * w,
                                     data=pixels.tobytes())
    first, old, new = (_frame(rng, 32, 32) for _ in range(3))
    assert readings.on_image(s, key, readings.stage(key, message(first)), (1, 0))
    before = readings.observation.vector.clone()
    decode = camera_readings.raw_pixels

    def restored_while_decoding(*args):
        s.forget_readings(readings.observation)     # the control thread's restore, meanwhile
        return decode(*args)
    monkeypatch.setattr(camera_readings, 'raw_pixels', restored_while_decoding)
    assert not readings.on_image(s, key, readings.stage(key, message(old)), (2, 0))
    assert key in readings.observation.missing() and 'camera:' + key not in s.inputs
    assert torch.equal(readings.observation.vector, before)
    assert len(logged) == 1 and 'before the state was replaced' in logged[0]
    monkeypatch.setattr(camera_readings, 'raw_pixels', decode)
    assert readings.on_image(s, key, readings.stage(key, message(new)), (3, 0))
    assert key not in readings.observation.missing() and s.inputs['camera:' + key][1] == (3, 0)
    assert torch.equal(readings.observation.image(key), torch.from_numpy(as_floats(new)))
