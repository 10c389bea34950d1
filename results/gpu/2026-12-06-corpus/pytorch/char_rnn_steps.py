# char_rnn's loop (tch-rs's example as the corpus runs it) in PyTorch, each step timed: does the
# host's time vary with 16 intra-op threads outside the tchmem kernel too?
import time, sys, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
text = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.\n" * 36)
chars = sorted(set(text)); labels = len(chars)
data = torch.tensor([chars.index(c) for c in text], dtype=torch.int64)
dev = "cuda"
lstm = nn.LSTM(labels, 256, batch_first=True).to(dev)
linear = nn.Linear(256, labels).to(dev)
params = list(lstm.parameters()) + list(linear.parameters())
opt = torch.optim.Adam(params, lr=0.01)
SEQ, B = 180, 256
def epoch():
    n = data.numel() - (SEQ + 1)
    perm = torch.randperm(n)
    times = []
    last = time.perf_counter()
    for i in range(n // B):
        idx = perm[i * B:(i + 1) * B]
        batch = torch.stack([data[j:j + SEQ + 1] for j in idx.tolist()])
        xs = torch.zeros(B, SEQ, labels).scatter_(-1, batch[:, :SEQ].unsqueeze(-1), 1.0)
        ys = batch[:, 1:]
        out, _ = lstm(xs.to(dev))
        loss = F.cross_entropy(linear(out).reshape(B * SEQ, labels), ys.to(dev).reshape(-1))
        opt.zero_grad(); loss.backward()
        for p in params: p.grad.clamp_(-0.5, 0.5)
        opt.step(); loss.item()
        now = time.perf_counter(); times.append(round((now - last) * 1e3, 1)); last = now
    return times
for threads in (torch.get_num_threads(), 1, 16):
    torch.set_num_threads(threads)
    all_t = []
    for _ in range(6): all_t += epoch()
    s = sorted(all_t[1:])
    print(f"threads {threads}: median {s[len(s)//2]} ms, min {s[0]}, max {s[-1]}, over 20 ms: {sum(t > 20 for t in s)} of {len(s)}")
    print("  ", all_t)
    sys.stdout.flush()
