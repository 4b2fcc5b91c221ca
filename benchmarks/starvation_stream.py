'''The planner's side of the control loop in the starvation benchmark: Stream publishes
numbered observations at a fixed rate, takes the actions, and counts loss and latency per
sequence number.
'''

# Standard library only at import, as every starvation module: the client processes are
# spawned and import them again (starvation.py says why).
import array
import math
import random
import threading
import time

from .starvation_node import OBS_DIM, SERVICES

QOS_DEPTH = 100
DRAIN_S = 1.0           # an action later than this after the last send counts as lost


class Stream:
    '''This process's side of the control loop: observations published on a paced thread,
    actions taken by a subscription; send and receive times (time.monotonic, one process)
    per sequence number.'''

    def __init__(self, rcl_node, target, rate):
        from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
        from std_msgs.msg import Float32MultiArray

        from flashrt_ros.executors import publisher_events

        self.node, self.target, self.period = rcl_node, target, 1.0 / rate
        self._msg_type = Float32MultiArray
        qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=QOS_DEPTH,
                         reliability=ReliabilityPolicy.RELIABLE)
        self.pub = rcl_node.create_publisher(Float32MultiArray, f'{target}/observation', qos,
                                             event_callbacks=publisher_events())
        self.sub = rcl_node.create_subscription(Float32MultiArray, f'{target}/action',
                                                self._on_action, qos)
        rng = random.Random(0)
        self._rest = [rng.uniform(-1.0, 1.0) for _ in range(OBS_DIM - 1)]
        self.next_seq = 1
        self._lock = threading.Lock()
        self.received = {}      # element 0 (float) -> receive time; the first arrival kept
        self.duplicates = 0
        self._arrived = threading.Condition(self._lock)

    def _on_action(self, msg):
        now = time.monotonic()
        value = float(msg.data[0]) if len(msg.data) else math.nan
        with self._lock:
            if value in self.received:
                self.duplicates += 1
            else:
                self.received[value] = now
            self._arrived.notify_all()

    def _publish(self, seq):
        msg = self._msg_type()
        msg.data = array.array('f', [float(seq)] + self._rest)
        self.pub.publish(msg)

    def wait_ready(self, timeout):
        '''The node's capsule services in the graph and both topics matched, then one echo.'''
        from flashrt_ros.client import wait_matched

        deadline = time.monotonic() + timeout
        for name in SERVICES:
            while self.node.count_services(f'{self.target}/{name}') == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f'{self.target}/{name} did not appear in {timeout} s')
                time.sleep(0.05)
        wait_matched([self.pub], [self.sub], deadline,
                     f'{self.target} observation/action did not connect in {timeout} s')
        while True:         # one observation answered: the node is active and stepping
            seq = self._take_seq()
            self._publish(seq)
            with self._lock:
                if self._arrived.wait_for(lambda: float(seq) in self.received, 1.0):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f'{self.target} answered no observation in {timeout} s')

    def _take_seq(self):
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if seq >= 2 ** 24:      # float32 holds integers exactly only below 2**24
            raise OverflowError('sequence numbers ran past 2**24')
        return seq

    def run(self, seconds):
        '''Streams for `seconds` on a thread, paced: message k at t0 + k * period (a late
        message goes at once; the schedule is kept, not restarted). Returns the sends,
        seq -> (scheduled time, send time), and the streamed window (t0, t0 + seconds).'''
        sends, window, count = {}, [], int(round(seconds / self.period))

        def loop():
            t0 = time.monotonic()
            for k in range(count):
                at = t0 + k * self.period
                delay = at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                seq = self._take_seq()
                sends[seq] = (at, time.monotonic())
                self._publish(seq)
            window.extend((t0, t0 + count * self.period))
        thread = threading.Thread(target=loop, name='observation-stream', daemon=True)
        thread.start()
        thread.join()
        return sends, tuple(window)

    def result(self, sends, window, drain_s=DRAIN_S):
        '''Waits until `drain_s` after the last send, then counts: lost = sent without an
        action by then; latency = receive - send per observation answered.'''
        from .timing import stats

        last = max(sent for _, sent in sends.values())
        time.sleep(max(0.0, last + drain_s - time.monotonic()))
        with self._lock:
            received = dict(self.received)
        latencies, lags, lost = [], [], []
        for seq, (at, sent) in sends.items():
            lags.append((sent - at) * 1e6)
            got = received.get(float(seq))
            if got is None:
                lost.append(seq)
            else:
                latencies.append((got - sent) * 1e6)
        sent = len(sends)
        return {'sent': sent, 'received': sent - len(lost), 'lost': len(lost),
                'lost_pct': 100.0 * len(lost) / sent if sent else math.nan,
                'latency_us': stats(latencies),
                # the sender's own lateness against its schedule: a starved sender shows
                # here, not as the node's latency
                'send_lag_us': stats(lags),
                'window_s': window[1] - window[0], 'lost_seqs': lost}

    def echo_check(self, sent_seqs):
        '''Every action's element 0 is an integer this stream sent (the echo holds).'''
        with self._lock:
            values = list(self.received)
            duplicates = self.duplicates
        foreign = [v for v in values if v not in sent_seqs]
        return {'actions': len(values), 'echoing_a_sent_sequence': len(values) - len(foreign),
                'not_echoing': len(foreign), 'not_echoing_examples': foreign[:5],
                'duplicates': duplicates}

    def close(self):
        self.node.destroy_publisher(self.pub)
        self.node.destroy_subscription(self.sub)
