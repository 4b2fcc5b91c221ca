"""What a benchmark run writes: progress lines on stdout (log), the results files (Report:
<out>.json and <out>.md, rewritten every time a section finishes) and the number formats the
tables share. Standard library only (environment.py says why).
"""

import json
import os
import time

MB = 1 << 20


def log(msg):
    print(msg, flush=True)


def micros(x):
    """Microseconds for a table cell: one decimal, milliseconds (marked) from 10 ms."""
    return f'{x / 1000:.2f} ms' if x >= 10000 else f'{x:.1f}'


def p50_p99(s):
    """A distribution's cell: 'p50 / p99' (stats() in timing.py)."""
    return f'{micros(s["p50"])} / {micros(s["p99"])}'


def environment_line(env):
    """The report's '- date: ...' line: date, torch, CUDA, Python, LeRobot and transformers
    where installed, and the project commit."""
    libraries = ''.join(f', {name} {env[key]}' for name, key in
                        (('LeRobot', 'lerobot'), ('transformers', 'transformers')) if key in env)
    return (f'- date: {env["date"]}, torch {env["torch"]}, CUDA {env["cuda"] or "-"}, Python '
            f'{env["python"]}{libraries}, commit {env["git_commit"]}'
            f'{" (modified)" if env["git_dirty"] else ""}')


def checks_and_command(results):
    """The report's closing lines: its identity checks (passed / all, each named) and the
    command that produced it."""
    checks = results['checks']
    out = [f'\n## Identity checks: {sum(c["passed"] for c in checks)} / {len(checks)}\n']
    out += [f'- {"passed" if c["passed"] else "FAILED"}: {c["name"]}' for c in checks]
    return out + [f'\nCommand: `{results.get("command", "")}`']


class Report:
    """Results so far; written to <out>.json and <out>.md every time a section finishes.
    render_md(results) -> markdown: the tables of the suite that writes the report."""

    def __init__(self, out, env, config, render_md):
        self.out = out
        self.render_md = render_md
        self.results = {'environment': env, 'config': config, 'sections': {}, 'checks': []}
        self.t0 = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)

    def publish(self, section, data):
        self.results['sections'][section] = data
        self.write()

    def write(self):
        self.results['elapsed_s'] = time.perf_counter() - self.t0
        tmp = self.out.with_suffix('.json.tmp')
        tmp.write_text(json.dumps(self.results, indent=1, default=str) + '\n')
        os.replace(tmp, self.out.with_suffix('.json'))
        self.out.with_suffix('.md').write_text(self.render_md(self.results))
