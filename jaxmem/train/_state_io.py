"""Train states in checkpoints: written as the pipeline holds them, shard by shard, and read back onto
any mesh.

A step holds the parameters and the optimizer state in the pipeline's own layout (stacked stage
leaves ``[ranks, layers, ...]``, the vocabulary split over the ranks where the run split it), each array
with the sharding it trains with: Orbax writes every shard from the device (and the process) that holds
it, so saving gathers nothing. ``meta["layout"]`` records the :class:`~jaxmem.pipeline.ParamLayout`.

Restoring reads each array onto the new run's sharding:

- the same layout (same stages per rank and layers per stage, the vocabulary split alike; any data,
  fsdp or replica count): every array keeps its shape, and each device reads only its own shard;
- another layout (other pipe size or layer split): one leaf at a time (all of its stage positions),
  read onto the host, re-laid out there (layers unstacked and restacked, vocabulary rows re-cut) and
  placed shard by shard. No device holds more than its shards; the host holds one leaf of the whole
  model at a time (twice, old and new), e.g. 7.5 GB for the MLP weights' Adam moment of llama-8b;
- steps saved before checkpoints were written from shards (the model's layout, replicated, with
  CRC32 checksums) are still read, the old way: whole on every device, then re-laid out.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem._util import tree_get as _get
from jaxmem._util import tree_with
from jaxmem.pipeline import ParamLayout, PipelineParams, vocab_rows, vocab_size
from jaxmem.train._checkpoint import StateReader
from jaxmem.train._state import global_put

__all__ = ["TrainStateReader", "model_params", "nest", "unnest"]


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _keys(path) -> tuple[str, ...]:
    return tuple(_key(k) for k in path)


def _insert(tree: dict, keys, value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def nest(tree) -> dict:
    """``tree`` as nested dicts with string keys (field names, indices, dict keys): what a checkpoint
    stores, whatever containers the optimizer's state uses."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        _insert(out, _keys(path), leaf)
    return out


def unnest(nested: dict, like):
    """The inverse of :func:`nest`: ``like``'s containers filled from ``nested``."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree.unflatten(treedef, [_get(nested, _keys(path)) for path, _ in paths])


def layout_state(model, optimizer, layout: ParamLayout) -> dict:
    """``{"params", "opt_state"}`` of ``model`` laid out by ``layout``, abstract (no shardings)."""
    params = jax.eval_shape(lambda p: PipelineParams(*layout.split(model, p)), model.abstract_params())
    return {"params": params, "opt_state": jax.eval_shape(optimizer.init, params)}


def _host(spec) -> jax.ShapeDtypeStruct:
    """Read onto the host (a leaf without a sharding)."""
    return jax.ShapeDtypeStruct(spec.shape, spec.dtype)


def model_params(params: dict, meta: dict, model):
    """A step's saved parameters (:func:`~jaxmem.train.read_params`, host arrays) in the model's own
    tree, whichever layout saved them."""
    if "layout" not in meta:
        return params  # saved in the model's layout
    layout = ParamLayout.from_json(meta["layout"])
    like = jax.eval_shape(lambda p: PipelineParams(*layout.split(model, p)), model.abstract_params())
    pipeline_params = unnest(params, like)
    return layout.join(model, pipeline_params.stages, pipeline_params.shared, pipeline_params.vocab)


class TrainStateReader(StateReader):
    """Reads a step into ``trainer``'s layout and shardings (module docstring); ``read`` returns
    ``{"params": PipelineParams, "opt_state": ...}``."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.layout = trainer.pipeline.param_layout

    # ------------------------------------------------------------------ what this run holds
    def target(self) -> dict:
        """This run's state, abstract, with its shardings."""
        trainer = self.trainer
        abstract = layout_state(trainer.model, trainer.optimizer, self.layout)
        shardings = {"params": trainer.pipeline.master_shardings(), "opt_state": trainer.opt_state_shardings()}
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def expected(self, meta: dict):
        if "layout" not in meta:
            return _legacy_target(self.trainer)
        saved = ParamLayout.from_json(meta["layout"])
        if saved == self.layout:
            return nest(self.target())
        return nest(layout_state(self.trainer.model, self.trainer.optimizer, saved))

    def read(self, meta: dict, fetch):
        if "layout" not in meta:
            return _legacy_import(self.trainer, fetch(_legacy_target(self.trainer)))
        saved = ParamLayout.from_json(meta["layout"])
        target = self.target()
        if saved == self.layout:
            return unnest(fetch(nest(target)), target)
        return self._relayout(saved, target, fetch)

    # ------------------------------------------------------------------ another layout
    def _relayout(self, saved: ParamLayout, target: dict, fetch) -> dict:
        model = self.trainer.model
        shapes = nest(layout_state(model, self.trainer.optimizer, saved))
        items, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: isinstance(x, PipelineParams))
        direct: dict = {}  # leaves read straight onto their shardings (same shape in both layouts)
        out: list = []
        for path, item in items:
            prefix = _keys(path)
            if not isinstance(item, PipelineParams):
                _insert(direct, prefix, item)
                out.append(("direct", prefix))
                continue
            stages = self._relayout_stages(saved, prefix, item, shapes, fetch)
            shared, vocab = self._relayout_shared(saved, prefix, item, shapes, fetch, direct)
            out.append(("node", (stages, shared, vocab)))
        read = fetch(direct, partial=True) if direct else {}
        leaves = []
        for kind, value in out:
            if kind == "direct":
                leaves.append(_get(read, value))
                continue
            stages, shared, vocab = value
            shared = jax.tree.map(lambda x: _get(read, x) if isinstance(x, tuple) else x, shared, is_leaf=_is_keys)
            leaves.append(PipelineParams(stages=stages, shared=shared, vocab=vocab))
        return jax.tree.unflatten(treedef, leaves)

    def _relayout_stages(self, saved, prefix, item: PipelineParams, shapes, fetch) -> tuple:
        """Each stage leaf: every saved stage position read onto the host, restacked, placed."""
        old_virtual = len(_get(shapes, (*prefix, "stages")))
        targets = [jax.tree.leaves(stage) for stage in item.stages]
        columns = []
        for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(item.stages[0])):
            inner = _keys(path)
            request: dict = {}
            for v in range(old_virtual):
                keys = (*prefix, "stages", str(v), *inner)
                _insert(request, keys, _host(_get(shapes, keys)))
            old = [_get(fetch(request, partial=True), (*prefix, "stages", str(v), *inner)) for v in range(old_virtual)]
            family = int(inner[0]) if saved.families is not None else None  # stages[v][family]...
            new = saved.relayout_stage_leaf(old, self.layout, family=family)
            columns.append([global_put(value, targets[v][i].sharding) for v, value in enumerate(new)])
            del old, new
        return tuple(
            jax.tree.unflatten(jax.tree.structure(item.stages[v]), [column[v] for column in columns])
            for v in range(len(item.stages))
        )

    def _relayout_shared(self, saved, prefix, item: PipelineParams, shapes, fetch, direct) -> tuple:
        """The shared leaves (read straight onto their shardings, queued in ``direct``) and the
        vocabulary tables (rows re-cut on the host when either layout splits them)."""
        spec = self.trainer.model.vocab
        moves = spec is not None and bool(saved.vocab_ranks or self.layout.vocab_ranks)
        tables = {tuple(p) for p in spec.paths().values()} if moves else set()

        def queue(path, leaf):
            keys = _keys(path)
            if keys in tables:
                return leaf  # filled below
            full = (*prefix, "shared", *keys)
            _insert(direct, full, leaf)
            return full

        shared = jax.tree_util.tree_map_with_path(queue, item.shared)
        vocab = {}
        if not moves:
            return shared, vocab
        size = vocab_size(self.trainer.model)
        for name, path in spec.paths().items():
            if saved.vocab_ranks:
                keys = (*prefix, "vocab", name)
                block = _get(fetch(_nested(keys, _host(_get(shapes, keys))), partial=True), keys)
                rows = block.reshape(-1, block.shape[-1])
            else:
                keys = (*prefix, "shared", *path)
                value = _get(fetch(_nested(keys, _host(_get(shapes, keys))), partial=True), keys)
                rows = value if name == "table" else value.T
            rows = rows[:size]
            if self.layout.vocab_ranks:
                ranks = self.layout.vocab_ranks
                per_rank = vocab_rows(size, ranks)
                padded = np.zeros((per_rank * ranks, rows.shape[1]), rows.dtype)
                padded[:size] = rows
                vocab[name] = global_put(padded.reshape(ranks, per_rank, -1), item.vocab[name].sharding)
            else:
                value = rows if name == "table" else np.ascontiguousarray(rows.T)
                shared = tree_with(shared, tuple(path), global_put(value, _get(item.shared, path).sharding))
        return shared, vocab


def _is_keys(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(k, str) for k in x)


def _nested(keys, value) -> dict:
    out: dict = {}
    _insert(out, keys, value)
    return out


def _to_model_layout(pipeline, tree):
    """Every PipelineParams in ``tree`` (the parameters, Adam's moments) in the model's layout."""
    return jax.tree.map(
        lambda x: pipeline.to_model_params(x) if isinstance(x, PipelineParams) else x,
        tree,
        is_leaf=lambda x: isinstance(x, PipelineParams),
    )


def _legacy_target(trainer) -> dict:
    """Abstract model-layout state replicated over ``trainer``'s mesh: how steps were saved before
    checkpoints were written from shards."""
    pipeline = trainer.pipeline
    abstract = jax.eval_shape(
        lambda p: {
            "params": _to_model_layout(pipeline, p),
            "opt_state": _to_model_layout(pipeline, trainer.optimizer.init(p)),
        },
        pipeline.abstract_params(),
    )
    replicated = NamedSharding(trainer.mesh, P())
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), abstract)


def _legacy_import(trainer, state: dict) -> dict:
    """A model-layout state (an old step) laid out for ``trainer``'s pipeline."""
    pipeline = trainer.pipeline
    target_opt = jax.eval_shape(trainer.optimizer.init, pipeline.abstract_params())

    def relayout(params, opt_state):
        opt = jax.tree.map(
            lambda target, value: pipeline.from_model_params(value) if isinstance(target, PipelineParams) else value,
            target_opt,
            opt_state,
            is_leaf=lambda x: isinstance(x, PipelineParams),
        )
        return pipeline.from_model_params(params), opt

    params, opt_state = jax.jit(relayout, out_shardings=(pipeline.master_shardings(), trainer.opt_state_shardings()))(
        state["params"], state["opt_state"]
    )
    return {"params": params, "opt_state": opt_state}
