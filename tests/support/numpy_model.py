"""Independent float64 numpy implementation of the K3 / Kimi Linear forward, written from the spec
(shared/design/k3-architecture.md), over the k3jax parameter tree. Slow and simple on purpose:
token loops, per-token expert loops, explicit attention.
"""
from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_dequant(packed, scale):
    """packed [..., N, K/2] uint8 (low nibble = even element), scale [..., N, K/32] E8M0 -> [..., N, K]."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    vals = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return vals * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=-1)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def act(g, u, c):
    if c.hidden_act == "silu":
        return g * sigmoid(g) * u
    b, bl = c.situ_beta, c.situ_linear_beta
    return b * np.tanh(g / b) * sigmoid(g) * (bl * np.tanh(u / bl) if bl is not None else u)


def mlp(p, x, c):
    return act(x @ p["gate"], x @ p["up"], c) @ p["down"]


def kda(p, x, c):
    T = x.shape[0]
    H, K = c.kda_num_heads, c.kda_head_dim
    outs = []
    for name in "qkv":
        xin = x @ p[f"{name}_proj"]
        w = p[f"{name}_conv"]                      # [Kc, C]
        kc = w.shape[0]
        pad = np.concatenate([np.zeros((kc - 1, xin.shape[1])), xin])
        y = np.stack([(pad[t:t + kc] * w).sum(0) for t in range(T)])
        outs.append((y * sigmoid(y)).reshape(T, H, K))
    q, k, v = outs
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * K ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    f = ((x @ p["f_a_proj"]) @ p["f_b_proj"] + p["dt_bias"]).reshape(T, H, K)
    a = np.exp(p["A_log"].reshape(-1)[:H])[None, :, None]
    if c.gate_lower_bound is None:
        g = -a * np.log1p(np.exp(f))
    else:
        g = c.gate_lower_bound * sigmoid(a * f)
    beta = sigmoid(x @ p["b_proj"])
    S = np.zeros((H, K, K))
    o = np.zeros((T, H, K))
    for t in range(T):
        S = S * np.exp(g[t])[:, :, None]
        pred = np.einsum("hkv,hk->hv", S, k[t])
        S = S + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    gate = x @ p["g_proj"] if "g_proj" in p else (x @ p["g_a_proj"]) @ p["g_b_proj"]
    o = rms(o, p["o_norm"], c.rms_norm_eps) * sigmoid(gate.reshape(T, H, K))
    return o.reshape(T, -1) @ p["o_proj"]


def mla(p, x, c):
    T, H = x.shape[0], c.mla_num_heads
    if "q_a_proj" in p:
        q = rms(x @ p["q_a_proj"], p["q_a_norm"], 1e-6) @ p["q_b_proj"]
    else:
        q = x @ p["q_proj"]
    q = q.reshape(T, H, -1)
    kv = x @ p["kv_a_proj"]
    ckv, kr = rms(kv[:, :c.kv_lora_rank], p["kv_a_norm"], 1e-6), kv[:, c.kv_lora_rank:]
    kvb = (ckv @ p["kv_b_proj"]).reshape(T, H, -1)
    kn, v = kvb[..., :c.qk_nope_head_dim], kvb[..., c.qk_nope_head_dim:]
    key = np.concatenate([kn, np.broadcast_to(kr[:, None], (T, H, kr.shape[-1]))], -1)
    s = np.einsum("qhd,khd->hqk", q, key) * (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", pr, v).reshape(T, -1)
    if "g_proj" in p:
        o = o * sigmoid(x @ p["g_proj"])
    return o @ p["o_proj"]


def expert_mats(pe, e):
    if "w1" in pe:
        return pe["w1"][e], pe["w3"][e], pe["w2"][e]
    return tuple(mxfp4_dequant(pe[f"{n}_packed"][e], pe[f"{n}_scale"][e]).T for n in ("w1", "w3", "w2"))


def routed_experts(choice, c):
    """Expert ids of one token from its biased scores [E]. With num_expert_group > 1 only the
    topk_group groups with the largest sum of their two best scores may be chosen."""
    if c.num_expert_group > 1:
        per = c.num_experts // c.num_expert_group
        groups = choice.reshape(c.num_expert_group, per)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        allowed = np.zeros(c.num_expert_group, bool)
        allowed[np.argsort(-group_score, kind="stable")[:c.topk_group]] = True
        choice = np.where(np.repeat(allowed, per), choice, -np.inf)
    return np.argsort(-choice, kind="stable")[:c.num_experts_per_token]


def moe(p, x, c):
    s = sigmoid(x @ p["router"])
    choice = s + p["router_bias"]
    out = np.zeros_like(x)
    z = x @ p["latent_down"] if "latent_down" in p else x
    mats = {}
    for t in range(x.shape[0]):
        ids = routed_experts(choice[t], c)
        w = s[t, ids]
        if c.moe_renormalize:
            w = w / (w.sum() + 1e-20)
        w = w * c.routed_scaling_factor
        y = np.zeros(z.shape[1])
        for e, we in zip(ids, w):
            if e not in mats:
                mats[e] = expert_mats(p["experts"], e)
            w1, w3, w2 = mats[e]
            y += we * (act(z[t] @ w1, z[t] @ w3, c) @ w2)
        if "latent_norm" in p:
            y = rms(y, p["latent_norm"], c.rms_norm_eps)
        out[t] = y @ p["latent_up"] if "latent_up" in p else y
    if "shared" in p:
        out = out + mlp(p["shared"], x, c)
    return out


def attn_res(prefix, blocks, proj, norm, eps):
    V = np.stack(blocks + [prefix])
    Kn = V / np.sqrt(np.mean(V * V, -1, keepdims=True) + eps)
    score = (Kn * norm * proj).sum(-1)
    e = np.exp(score - score.max(0))
    pr = e / e.sum(0)
    return (pr[..., None] * V).sum(0)


def forward(params, c, tokens):
    """tokens [T] -> logits [T, V] (float64)."""
    P = _to64(params)
    eps = c.rms_norm_eps
    x = P["embed"][np.asarray(tokens)]

    def attn(i, lp, h):
        return kda(lp["attn"], h, c) if c.layer_types[i] == "kda" else mla(lp["attn"], h, c)

    def ffn(lp, h):
        return moe(lp["mlp"], h, c) if "router" in lp["mlp"] else mlp(lp["mlp"], h, c)

    if not c.attn_res_block_size:
        for i, lp in enumerate(P["layers"]):
            x = x + attn(i, lp, rms(x, lp["input_norm"], eps))
            x = x + ffn(lp, rms(x, lp["post_attn_norm"], eps))
        h = x
    else:
        prefix, blocks = x, []
        for i, lp in enumerate(P["layers"]):
            r = lp["attn_res"]
            h = attn_res(prefix, blocks, r["attn_proj"], r["attn_norm"], eps) if blocks else prefix
            if i % c.attn_res_block_size == 0:
                blocks.append(prefix)
                prefix = None
            a = attn(i, lp, rms(h, lp["input_norm"], eps))
            prefix = a if prefix is None else prefix + a
            m = attn_res(prefix, blocks, r["mlp_proj"], r["mlp_norm"], eps)
            prefix = prefix + ffn(lp, rms(m, lp["post_attn_norm"], eps))
        o = P["output_attn_res"]
        h = attn_res(prefix, blocks, o["proj"], o["norm"], eps)
    h = rms(h, P["final_norm"], eps)
    return h @ (P["lm_head"] if "lm_head" in P else P["embed"].T)


def _to64(tree):
    if isinstance(tree, dict):
        return {k: _to64(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to64(v) for v in tree]
    a = np.asarray(tree)
    return a if a.dtype == np.uint8 else a.astype(np.float64)
