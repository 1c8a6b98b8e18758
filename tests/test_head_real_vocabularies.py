"""The chunked head (ipuft.head_loss) at real vocabularies equals the unchunked head (F.cross_entropy's
arithmetic, as transformers') to float32 rounding: loss and the gradients of the hidden states, the projection
(tied to the embeddings or not) and the final norm, at chunks of 1 token, of an uneven few, of the whole
sequence, of 512 and of 1000; at widths 576 and 4096 (GPT-J-6B's and Llama 3 8B's, where the float64 reference
takes the projection a slice of its rows at a time).

The logits are peaked as a trained model's are (a logit spread of about 8, labels drawn from the softmax): the
case where the chunked head's former log-sum-exp (shifted exponentials summed by torch.sum) and F.cross_entropy's
CPU log-softmax (summed term by term) differed by 5e-6 of the loss and 7e-6 of the gradients at 49152 rows."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ipuft.components import IGNORE_INDEX
from ipuft.head_loss import head_chunks
from ipuft_llama.modules import LlamaLMHead


def rel(a: torch.Tensor, b: torch.Tensor, piece: int = 1 << 22) -> float:
    """The largest difference relative to the largest magnitude (float32 differences of near-equal values are
    exact, and a large gradient is not copied to float64), ``piece`` elements at a time: a 128256 x 4096
    gradient's whole difference and magnitudes are 2 GiB temporaries each, whose pages the kernel faults in anew
    at every call (half of this file's time went to them). The pieces' maxima are taken by torch, which keeps a
    NaN where Python's max may drop it."""
    a, b = a.reshape(-1), b.reshape(-1)
    pieces = range(0, b.numel(), piece)
    most = torch.stack([(a[i : i + piece] - b[i : i + piece]).abs().max() for i in pieces]).max()
    return float(most / torch.stack([b[i : i + piece].abs().max() for i in pieces]).max())


def case(vocab: int, width: int, tokens: int, tied: bool):
    """Llama's head (its RMSNorm's weight perturbed) with a peaked projection; tied: the hidden states begin with
    the projection's own rows looked up as embeddings, so that its gradient holds both uses."""
    torch.manual_seed(0)
    head = LlamaLMHead(width, vocab, 1e-5, tied=tied)
    with torch.no_grad():
        head.lm_head.weight.normal_(0.0, 8.0 / width**0.5)
        head.norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(1, tokens, width)
    ids = torch.randint(0, vocab, (1, tokens))
    with torch.no_grad():
        logits = F.linear(F.rms_norm(hidden, (width,), head.norm.weight, 1e-5), head.lm_head.weight)
        labels = torch.multinomial(logits[0].softmax(-1), 1).view(1, tokens)
    labels[0, ::7] = IGNORE_INDEX
    return head, hidden, ids, labels


def run(head, hidden, ids, labels, chunk: int, seed: float = 2.0):
    """The loss and gradients of ``seed · loss`` with the head's loss ``chunk`` tokens at a time (0: unchunked)."""
    x = hidden.clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    h = x + F.embedding(ids, head.lm_head.weight) if head.tied else x
    with head_chunks(chunk, seed):
        loss = head(h, labels)
    (loss * seed).backward()
    grads = {"hidden": x.grad, "weight": head.lm_head.weight.grad, "norm": head.norm.weight.grad}
    head.zero_grad(set_to_none=True)
    return loss.detach(), grads


def exact_gradients(head, hidden, ids, labels, seed: float = 2.0) -> dict[str, torch.Tensor]:
    """The same gradients in float64 (a float64 copy of the head, the plain cross-entropy)."""
    wide = copy.deepcopy(head).double()
    x = hidden.double().requires_grad_()
    h = x + F.embedding(ids, wide.lm_head.weight) if head.tied else x
    loss = F.cross_entropy(wide.lm_head(wide.norm(h))[0], labels[0], ignore_index=IGNORE_INDEX)
    (loss * seed).backward()
    return {"hidden": x.grad, "weight": wide.lm_head.weight.grad, "norm": wide.norm.weight.grad}


def exact_gradients_by_slices(head, hidden, ids, labels, seed: float = 2.0, rows: int = 8192):
    """:func:`exact_gradients` with the projection taken in float64 ``rows`` vocabulary rows at a time (at width
    4096 a float64 copy of a 128256-row projection and its gradient would be 8 GiB): the log-sum-exp over the
    slices' own, then the hidden states' gradient, then each slice's weight gradient from the logits' gradient
    kept on the way (with the tied lookup's rows), rounded to float32 once, which is 6e-8 of its largest entry, far inside the bounds."""
    weight = head.lm_head.weight.detach()
    norm = copy.deepcopy(head.norm).double()
    x = hidden.double().requires_grad_()
    h = x + F.embedding(ids, weight).double() if head.tied else x
    normed = norm(h)[0]
    n, y = normed.detach(), labels[0]
    keep = y != IGNORE_INDEX
    scale = (keep.double() * seed / keep.sum()).unsqueeze(1)

    def slices():  # each slice widened in turn: one float64 slice at a time
        for start in range(0, weight.shape[0], rows):
            yield start, weight[start : start + rows].double()

    def probabilities(start, w, lse):  # (softmax - one-hot) · seed / count, this slice's columns
        d = (n @ w.T - lse.unsqueeze(1)).exp()
        inside = keep & (y >= start) & (y < start + w.shape[0])
        d[inside.nonzero()[:, 0], y[inside] - start] -= 1.0
        return d * scale

    lse = torch.logsumexp(torch.stack([torch.logsumexp(n @ w.T, dim=1) for _, w in slices()]), dim=0)
    grad_n, logits_grads = 0.0, {}  # each slice's d(loss)/d(logits), [tokens, rows]: kept for its weight gradient
    for start, w in slices():
        logits_grads[start] = probabilities(start, w, lse)
        grad_n = grad_n + logits_grads[start] @ w
    normed.backward(grad_n)
    grad_w = torch.empty_like(weight)
    for start, d in logits_grads.items():
        piece = d.T @ n
        if head.tied:  # the lookup's rows: each touched row gains the hidden states' gradient where it was looked up
            inside = (ids[0] >= start) & (ids[0] < start + d.shape[1])
            piece.index_add_(0, ids[0][inside] - start, x.grad[0][inside])
        grad_w[start : start + d.shape[1]] = piece.float()
    return {"hidden": x.grad, "weight": grad_w, "norm": norm.weight.grad}


CASES = [  # (vocabulary, width, tokens, tied): chunks of 512 and 1000 hold the whole sequence here.
    (49152, 576, 8, False), (49152, 576, 8, True), (128256, 576, 6, False),
    (49152, 4096, 4, True), (128256, 4096, 4, False),  # GPT-J / Llama-3 width, the float64 projection by slices
]


@pytest.mark.parametrize(("vocab", "width", "tokens", "tied"), CASES,
                         ids=[f"{v}x{w}-{'tied' if t else 'untied'}" for v, w, _, t in CASES])
def test_the_chunked_head_equals_the_unchunked_at_real_vocabularies(vocab, width, tokens, tied):
    """The loss within 1e-6 relative of the unchunked head's; each gradient as near the float64 gradient as the
    unchunked head's is, within 1e-6 relative (largest difference over largest magnitude). A gradient of the
    hidden states sums over the whole vocabulary, which float32 rounds to about 2e-6 of the exact sum, otherwise
    in each BLAS kernel and thread split of a matmul of 4 or 12 rows: two float32 heads are not nearer."""
    head, hidden, ids, labels = case(vocab, width, tokens, tied)
    exact = (exact_gradients if width < 1024 else exact_gradients_by_slices)(head, hidden, ids, labels)
    want_loss, want = run(head, hidden, ids, labels, 0)
    floor = {name: rel(g.to(exact[name].dtype), exact[name]) for name, g in want.items()}
    del want
    # At width 4096 a chunk of 512 or 1000 is the one chunk of the whole sequence: run once, as 512.
    for chunk in (1, 3, tokens, 512, 1000) if width < 1024 else (1, 3, 512):
        loss, got = run(head, hidden, ids, labels, chunk)
        assert rel(loss, want_loss) <= 1e-6, chunk
        for name, g in got.items():
            assert rel(g.to(exact[name].dtype), exact[name]) <= floor[name] + 1e-6, (chunk, name)
        del got
