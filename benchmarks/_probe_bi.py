import time, torch, sys
torch.manual_seed(0)
dev = 'cuda'
print(torch.__version__, torch.cuda.get_device_name())
try:
    import triton; print('triton', triton.__version__)
except Exception as e:
    print('no triton', e)

def bmm_lin(x, W, b):
    n = x.shape[0]
    return torch.baddbmm(b.expand(n, 1, -1), x.unsqueeze(1), W.t().expand(n, -1, -1)).squeeze(1)

def act(y):
    wide = y.new_empty(*y.shape, 2)
    wide[..., 0].copy_(y)
    return torch.nn.functional.elu(wide[..., 0])

dims = [47, 512, 256, 128, 12]
Ws = [(torch.randn(o, i, device=dev) * 0.1, torch.randn(o, device=dev)) for i, o in zip(dims[:-1], dims[1:])]
def mlp(x, lin, a):
    for j, (W, b) in enumerate(Ws):
        x = lin(x, W, b)
        if j < len(Ws) - 1: x = a(x)
    return x
xs = torch.randn(4096, 47, device=dev) * 3
for name, lin in [('bmm', bmm_lin), ('mm', torch.nn.functional.linear)]:
    ref = torch.cat([mlp(xs[i:i + 1], lin, act) for i in range(4096)])
    bad = []
    for n in list(range(1, 70)) + [100, 127, 128, 129, 255, 256, 511, 512, 513, 1000, 1024, 2047, 2048, 3000, 4095, 4096]:
        out = mlp(xs[:n], lin, act)
        if not torch.equal(out, ref[:n]): bad.append(n)
    print(name, 'not invariant at', bad[:20], len(bad))
    for n in (1, 512, 4096):
        x = xs[:n].clone()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): mlp(x, lin, act)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = mlp(x, lin, act)
        for _ in range(10): g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(200):
            t = time.perf_counter(); g.replay(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        ts.sort()
        print(f'  {name} N={n} graph replay p50 {ts[100]*1e6:.1f} us')
# LSTM via bmm
H, I = 64, 64
Wih, Whh = torch.randn(4 * H, I, device=dev) * .1, torch.randn(4 * H, H, device=dev) * .1
bih, bhh = torch.randn(4 * H, device=dev), torch.randn(4 * H, device=dev)
def sig(y):
    wide = y.new_empty(*y.shape, 2); wide[..., 0].copy_(y); return torch.sigmoid(wide[..., 0])
def tnh(y):
    wide = y.new_empty(*y.shape, 2); wide[..., 0].copy_(y); return torch.tanh(wide[..., 0])
def cell(x, h, c, lin):
    g = lin(x, Wih, bih) + lin(h, Whh, bhh)
    i, f, gg, o = g.chunk(4, 1)
    c2 = sig(f) * c + sig(i) * tnh(gg)
    return sig(o) * tnh(c2), c2
x, h, c = (torch.randn(4096, H, device=dev) for _ in range(3))
for name, lin in [('bmm', bmm_lin), ('mm', torch.nn.functional.linear)]:
    ref = [cell(x[i:i+1], h[i:i+1], c[i:i+1], lin) for i in range(4096)]
    refh = torch.cat([r[0] for r in ref])
    bad = [n for n in [2, 3, 17, 64, 512, 513, 4096] if not torch.equal(cell(x[:n], h[:n], c[:n], lin)[0], refh[:n])]
    print('lstm', name, 'not invariant at', bad)

try:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=['M'])
    def _lin(x, w, b, y, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            rk = k + tl.arange(0, BK)
            a = tl.load(x + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.)
            bb = tl.load(w + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.)
            acc += tl.dot(a, bb, input_precision='ieee')
        acc += tl.load(b + rn, mask=rn < N, other=0.)[None, :]
        tl.store(y + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    def tri_lin(x, W, b):
        M, K = x.shape; N = W.shape[0]
        y = torch.empty(M, N, device=x.device)
        _lin[(triton.cdiv(M, 32), triton.cdiv(N, 64))](x, W, b, y, M, N, K, BM=32, BN=64, BK=32)
        return y
    ref = torch.cat([mlp(xs[i:i + 1], tri_lin, act) for i in range(4096)])
    bad = [n for n in list(range(1, 70)) + [511, 512, 513, 4095, 4096] if not torch.equal(mlp(xs[:n], tri_lin, act), ref[:n])]
    print('triton not invariant at', bad)
    print('triton vs mm max', (ref - mlp(xs, torch.nn.functional.linear, act)).abs().max().item())
    for n in (1, 512, 4096):
        x = xs[:n].clone()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): mlp(x, tri_lin, act)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = mlp(x, tri_lin, act)
        for _ in range(10): g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(200):
            t = time.perf_counter(); g.replay(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        ts.sort()
        print(f'  triton N={n} graph replay p50 {ts[100]*1e6:.1f} us')
except Exception as e:
    import traceback; traceback.print_exc()
