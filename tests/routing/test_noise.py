"""The counter-based noise: pinned values (a run resumed on any revision draws the same noise), the
host-folded scalar fields and the all-axes computation equal to one call per axis."""

import torch

from megatron_triroute.routing.noise import NoiseKey, _field, _link, counter_gumbel, counter_words, hash_keys, token_words

# Values of the hash as it was first released (the chain over int64 tensors for every field):
# any change to the arithmetic changes every routing decision of a resumed run.
PINNED_HASHES = [110443989, 3588257945, 3787934666, 4074861034, 3603806371, 264902909, 3087027879,
                 2049655347, 1638050376, 36228172, 2799802813, 2340869657, 2905142842, 3296482229,
                 926326268, 36936134, 3210699185, 2961949503]


def test_hash_is_pinned_to_its_released_values():
    h = hash_keys(7, 3, 1, 0, torch.tensor([0, 5]).view(2, 1, 1), torch.tensor([0, 1, 2047]).view(1, 3, 1),
                  torch.arange(3).view(1, 1, 3))
    assert h.flatten().tolist() == PINNED_HASHES
    assert hash_keys(-1, 2**40 + 5).item() == 3501442335  # negative and wide keys wrap as int64 & 2^32-1


def test_host_folded_fields_equal_the_tensor_chain():
    # The same fields as tensors from the start: the chain stays on int64 tensors throughout.
    keys = (123, 2**33 + 9, 7, 2, torch.arange(4).view(4, 1), torch.arange(5).view(1, 5))
    as_tensors = [torch.as_tensor(k) for k in keys]
    h = None
    for i, k in enumerate(as_tensors):
        h = _field(k, i) if h is None else _link(h, _field(k, i))
    assert torch.equal(hash_keys(*keys), h)


def test_noise_is_pinned_and_all_axes_at_once_equal_one_call_per_axis():
    key = NoiseKey(11, 123456, 3, torch.arange(4, 7), torch.arange(2, 7))
    shapes = {0: (3, 5, 4, 3), 2: (3, 5, 3), 1: (3, 5, 6)}
    together = key.gumbel_axes(shapes)
    pinned = {0: 98.81806868873537, 2: 26.834429867565632, 1: 56.483489982783794}
    for axis, shape in shapes.items():
        alone = key.gumbel(shape, axis)
        assert alone.shape == shape and alone.dtype == torch.float32
        assert torch.equal(together[axis], alone)
        assert alone.double().sum().item() == pinned[axis]
    # Per-sample positions (B, T), e.g. packed documents.
    packed = NoiseKey(11, 9, 0, torch.arange(2), torch.arange(6).view(1, 6) + torch.tensor([[0], [3]]))
    assert packed.gumbel((2, 6, 2), 0).double().sum().item() == 19.58718980103731


def test_counter_gumbel_takes_step_and_layer_as_a_tensor():
    key = NoiseKey(5, 17, 2, torch.arange(3), torch.arange(4))
    prefix = torch.tensor([key.prefix(0), key.prefix(1)])
    g = counter_gumbel(prefix, *token_words(torch.arange(3), torch.arange(4)), counter_words(6, "cpu"))  # (A, B, T, n)
    assert g.shape == (2, 3, 4, 6) and g.dtype == torch.float64
    assert torch.equal(g[1].float(), key.gumbel((3, 4, 6), 1))
    assert not torch.equal(g[0], g[1])


def test_a_key_given_its_token_words_draws_the_same_noise():
    sample = torch.tensor([4, 9])
    for positions in (torch.arange(5), torch.arange(5).view(1, 5) + torch.tensor([[0], [7]])):
        plain = NoiseKey(11, 3, 1, sample, positions)
        shared = NoiseKey(11, 3, 1, sample, positions, lambda: token_words(sample, positions))
        for shapes in ({0: (2, 5, 3, 3)}, {0: (2, 5, 2, 3), 2: (2, 5, 4)}):
            a, b = plain.gumbel_axes(shapes), shared.gumbel_axes(shapes)
            assert all(torch.equal(a[k], b[k]) for k in shapes)
    wrong = NoiseKey(11, 3, 1, sample, torch.arange(5), lambda: token_words(sample, torch.arange(1, 6)))
    assert not torch.equal(wrong.gumbel((2, 5, 3), 0), NoiseKey(11, 3, 1, sample, torch.arange(5)).gumbel((2, 5, 3), 0))


def test_the_hash_kernel_equals_the_tensor_chain_bit_for_bit(monkeypatch):
    """`counter_uniform` through the C++ kernel (where built) and through the tensor chain: the same
    float64 bits, for words at the ends of the 32-bit range, one position row or one per sample; the
    pinned noise of the test above holds with the kernel off too."""
    from triroute_kernels import cpu_ops_available

    from megatron_triroute.routing import noise

    assert cpu_ops_available(), "the C++ kernels did not build here"
    g = torch.Generator().manual_seed(0)
    words = lambda *shape: torch.randint(0, 2**32, shape, generator=g, dtype=torch.int64)  # noqa: E731
    prefix, sample = words(3), words(4)
    sample[0], prefix[0] = 0, 2**32 - 1
    for positions in (words(1, 7), words(4, 7)):
        counters = counter_words(5, "cpu")
        via_kernel = noise.counter_uniform(prefix, sample, positions, counters)
        chain = noise.counter_uniform_torch(prefix, sample, positions, counters)
        assert via_kernel.shape == (3, 4, 7, 5) and via_kernel.dtype == torch.float64
        assert torch.equal(via_kernel, chain)
        assert torch.equal(torch.ops.triroute.counter_uniform(prefix, sample, positions, counters), chain)
    # the per-token words: every key field the chain has, keys at the ends of the 32-bit range and
    # beyond (only the low 32 bits are a key's), any shape
    keys = torch.cat([words(40), torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 5])]).view(-1, 1)
    for field in range(7):
        want = noise.chain_words_torch(keys, field)
        assert torch.equal(torch.ops.triroute.chain_words(keys, field), want)
        assert torch.equal(noise.chain_words(keys.view(1, -1), field), want.view(1, -1))
    assert not torch.equal(noise.chain_words(keys, 4), noise.chain_words(keys, 5))
    torch.library.opcheck(torch.ops.triroute.chain_words, (keys, 5))
    calls = []
    monkeypatch.setattr(noise, "_hash_kernel", lambda device: calls.append(device))  # None: no kernel
    monkeypatch.setattr(noise, "_words_kernel", lambda device: calls.append(device))
    test_noise_is_pinned_and_all_axes_at_once_equal_one_call_per_axis()
    assert calls  # the chain ran
