"""A numpy re-implementation of kvxfer's reference sharding (layout/reference.go:
Shard), written from its definition, for checking what the binding moved.

A logical cache is an array [layers][kv_factor][kv_heads][tokens][head_dim]
of elements (here: unsigned integers of the dtype's size, so that every bit
pattern compares exactly). Rank r of a state holds the layers of its PP
stage and the heads of its TP rank (H/T consecutive heads when T divides
H, else the one head r/(T/H), duplicated), cut into blocks of
tokens_per_block tokens; token slots past the prompt stay zero."""

import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
SIZES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


def kv_factor(state):
    if state.kv_factor:
        return state.kv_factor
    return 1 if state.attention.lower() == "mla" else 2


def logical(state, tokens, seed):
    """A logical cache of tokens tokens, filled from seed."""
    rng = np.random.default_rng(seed)
    dt = _UINT[SIZES[state.dtype]]
    shape = (state.layers, kv_factor(state), state.kv_heads, tokens, state.head_dim)
    return rng.integers(0, np.iinfo(dt).max, size=shape, dtype=dt, endpoint=True)


def layer_range(state, pp_rank):
    if state.layers_per_pp:
        lo = sum(state.layers_per_pp[:pp_rank])
        return lo, lo + state.layers_per_pp[pp_rank]
    base, rem = divmod(state.layers, state.pp)
    lo = pp_rank * base + min(pp_rank, rem)
    return lo, lo + base + (1 if pp_rank < rem else 0)


def head_range(state, rank):
    tp_rank = rank % state.tp
    t = state.tp // state.dp_size if state.attention_dp and state.dp_size else state.tp
    local = tp_rank % t
    h = state.kv_heads
    if h % t == 0:
        n = h // t
        return local * n, local * n + n
    per = t // h
    return local // per, local // per + 1


def shard(cache, state, rank):
    """The blocks rank holds of cache: an array [blocks][layers][kv][heads][tokens_per_block][head_dim]."""
    pp = rank // state.tp
    lo, hi = layer_range(state, pp)
    hlo, hhi = head_range(state, rank)
    tpb = state.tokens_per_block
    tokens = cache.shape[3]
    nb = -(-tokens // tpb)
    part = np.zeros(cache.shape[:3] + (nb * tpb, cache.shape[4]), dtype=cache.dtype)
    part[:, :, :, :tokens, :] = cache
    part = part[lo:hi, :, hlo:hhi]
    L, K, H, _, D = part.shape
    return np.ascontiguousarray(part.reshape(L, K, H, nb, tpb, D).transpose(3, 0, 1, 2, 4, 5))


def num_blocks(tokens, tokens_per_block):
    return -(-tokens // tokens_per_block)
