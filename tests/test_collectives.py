"""Collectives on the slice's physical rings (k2jax.ops.collectives) and the rings themselves
(k2jax.sharding.axis_rings): equal to one all-gather, on 8 simulated CPU devices given rings."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import k2jax.sharding as sharding
from k2jax.ops.collectives import gather
from k2jax.sharding import axis_rings, make_mesh, use_mesh


def _fake_mesh(coords, name="expert"):
    devices = np.empty(len(coords), object)
    devices[:] = [types.SimpleNamespace(coords=c) for c in coords]
    return types.SimpleNamespace(axis_names=(name,), devices=devices)


def test_axis_rings_from_device_coordinates():
    # z fastest, then y, then x: as jax lays out expert=64 on v5p:4x4x4
    cube = [(x, y, z) for x in range(4) for y in range(4) for z in range(4)]
    assert axis_rings(_fake_mesh(cube)) == {"expert": (4, 4, 4)}
    assert axis_rings(_fake_mesh([(x, y, 0) for x in range(2) for y in range(8)])) == {"expert": (2, 8)}
    # one physical axis: one ring, nothing to split
    assert axis_rings(_fake_mesh([(0, y, 0) for y in range(8)])) == {}
    # an order that is no product of rings (the second half walks y backwards, then x changes mid-ring)
    odd = [(0, y, 0) for y in range(4)] + [(1, 3, 0), (1, 2, 0), (0, 0, 1), (1, 0, 0)]
    assert axis_rings(_fake_mesh(odd)) == {}
    # devices without coordinates (CPU)
    assert axis_rings(make_mesh("expert=8")) == {}


@pytest.mark.parametrize("spec, rings, axes", [("expert=8", {"expert": (2, 2, 2)}, ("expert",)),
                                               ("expert=8", {"expert": (4, 2)}, ("expert",)),
                                               ("data=2,expert=4", {"expert": (2, 2)}, ("data", "expert"))])
def test_gather_by_rings_equals_one_all_gather(spec, rings, axes, monkeypatch):
    monkeypatch.setattr(sharding, "axis_rings", lambda mesh: rings)
    mesh = make_mesh(spec)
    x = jnp.arange(3 * 16 * 5, dtype=jnp.float32).reshape(3, 16, 5)

    def run(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(None, axes), out_specs=P(), check_vma=False))

    with use_mesh(mesh):
        by_rings = run(lambda s: gather(s, axes, 1))
        got, text = by_rings(x), by_rings.lower(x).as_text()
    np.testing.assert_array_equal(got, x)
    want = run(lambda s: jax.lax.all_gather(s, axes, axis=1, tiled=True))(x)
    np.testing.assert_array_equal(got, want)
    # one all-gather per ring, each within groups of that ring's size
    stages = [s for r in rings.values() for s in r if s > 1] + [mesh.shape[a] for a in axes if a not in rings]
    found = re.findall(r"all_gather.*?replica_groups = dense<(\[\[[^>]*\]\])>", text)
    assert len(found) == len(stages), text
    assert sorted(len(eval(g)[0]) for g in found) == sorted(stages)


@pytest.mark.parametrize("F, rings, groups", [(128, (2, 4), 4),   # tokens gathered in rings of 4
                                               (16, (2, 4), 1),    # the weights gathered whole
                                               (512, (2, 4), 8),   # the tokens gathered over every device
                                               (128, None, 8),     # no rings known: the tokens ...
                                               (16, None, 1)])     # ... or the weights, whole
def test_mlp_on_split_tokens_shares_the_work_in_groups_along_rings(F, rings, groups, monkeypatch):
    """A lone row's 64 tokens split over 8 devices (t = 8), the MLP's hidden width too: groups of k devices
    gather their tokens, each member the weights of F/k columns, and reduce-scatter the partial outputs
    (k2jax.ops.split_mlp; k from 3F/k + 2kt). Output and gradients equal one device's."""
    from k2jax.nn.mlp import MLP
    from k2jax.ops.split_mlp import group_rings

    monkeypatch.setattr(sharding, "axis_rings", lambda mesh: {} if rings is None else {"expert": rings})
    D, T = 32, 64
    sizes = rings or (8,)
    j = group_rings(F, T // 8, sizes)
    assert int(np.prod(list(reversed(sizes))[:j])) == groups
    mlp = MLP(F, jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, T, D))
    params = mlp.init(jax.random.PRNGKey(1), x)["params"]
    params = jax.tree.map(lambda v: getattr(v, "value", v), params, is_leaf=lambda v: hasattr(v, "value"))

    def loss(p, x):
        y = mlp.apply({"params": p}, sharding.constrain(x, ("batch", "length", "act_embed")))
        return jnp.sum(y * y), y

    want_grads, want = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    mesh = make_mesh("expert=8")
    step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    with use_mesh(mesh):
        specs = {k: sharding.logical_to_spec(n, params[k].shape, dict(mesh.shape))
                 for k, n in (("gate_proj", ("embed", "mlp")), ("up_proj", ("embed", "mlp")),
                              ("down_proj", ("mlp", "embed")))}
        placed = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, specs[k])) for k, v in params.items()}
        got_grads, got = step(placed, x)
        text = jax.jit(loss).lower(placed, x).as_text()  # the forward alone
    assert sharding.shard_count(specs["gate_proj"][1], dict(mesh.shape)) == 8  # split where the tokens are
    scattered = re.findall(r"reduce_scatter.*?replica_groups = dense<(\[\[[^>]*\]\])>", text)
    if groups > 1:  # the partial outputs summed within groups of k
        assert scattered and len(eval(scattered[0])[0]) == groups, scattered
    else:
        assert not scattered
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
