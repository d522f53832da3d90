"""Evaluation over the ranks: every sample exactly once, the loss summed over the ranks, and the predictions for
compute_metrics gathered back into dataset order.

    indices = shard(len(dataset), world.rank, world.world_size, batch_size)
    part = accumulate(batches, forward, want_predictions=True)     # forward(batch) -> (loss, logits, labels, ...)
    metrics = over_ranks(comm, part, indices, "eval", compute_metrics, world.device)   # no eval_loss without labels

Which keys of a batch are its labels is Transformers' rule: `label_names`, by default the model's forward
parameters whose name holds "label" (label_names_of); a batch has labels when it holds every one of them
(labels_named), and compute_metrics gets them as label_ids: one array, or a tuple of arrays for several names.
As in Transformers' evaluation_loop, a set whose batches have none gets no loss and no compute_metrics call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ddpkit.distributed.comm import Comm, gather_objects, sum_over_ranks
from ddpkit.trainer import model_io
from ddpkit.trainer.state import EvalPrediction


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode for the body, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def label_names_of(model: torch.nn.Module, label_names: Sequence[str] | None = None) -> list[str]:
    """The batch keys that hold the labels: `label_names` (TrainingArguments'), else the parameters of the model's
    forward whose name holds "label" (and a question-answering model's start_positions, end_positions)."""
    if label_names is not None:
        return list(label_names)
    model = model_io.unwrapped(model)
    answers = ("start_positions", "end_positions") if "QuestionAnswering" in type(model).__name__ else ()
    return [p for p in inspect.signature(model.forward).parameters if "label" in p or p in answers]


def can_return_loss(model: torch.nn.Module) -> bool:
    """Whether the model's forward returns a loss without labels by default (return_loss=True, as CLIP's does)."""
    found = inspect.signature(model_io.unwrapped(model).forward).parameters.get("return_loss")
    return found is not None and found.default is True


def labels_named(inputs: Any, names: Sequence[str]) -> Any:
    """The batch's labels: its tensor under the one name, a tuple of them for several; None unless `names` is not
    empty and the batch is a mapping that holds every one of them (Transformers' has_labels)."""
    if not names or not isinstance(inputs, Mapping) or any(inputs.get(name) is None for name in names):
        return None
    found = tuple(inputs[name] for name in names)
    return found[0] if len(found) == 1 else found


def add_speed(metrics: dict[str, float], prefix: str, runtime: float, samples: int, global_batch: int) -> None:
    """Transformers' speed metrics, rounded as its speed_metrics rounds them (the runtime to 4 decimals, the rates,
    from the unrounded runtime, to 3); a step is one batch on every rank: ceil(samples / global_batch) of them."""
    metrics[f"{prefix}_runtime"] = round(runtime, 4)
    metrics[f"{prefix}_samples_per_second"] = round(samples / max(runtime, 1e-9), 3)
    metrics[f"{prefix}_steps_per_second"] = round(math.ceil(samples / global_batch) / max(runtime, 1e-9), 3)


def shard(n: int, rank: int, world_size: int, batch_size: int = 1) -> list[int]:
    """Rank r's samples: the batches of `batch_size` consecutive samples one process would evaluate (0..b-1,
    b..2b-1, ...), batch k to rank k % world_size; no padding, so no sample is counted twice. Only the last batch
    of all may be short, so a rank's loader, batching its list by batch_size, makes exactly these batches."""
    starts = range(rank * batch_size, n, world_size * batch_size)
    return [i for start in starts for i in range(start, min(start + batch_size, n))]


@dataclasses.dataclass
class Part:
    """One rank's share of an evaluation.

    The loss is Transformers' eval_loss: each batch's loss weighted by its samples (its evaluation_loop repeats a
    batch's loss batch-size times, gather_for_metrics cutting the last batch's copies to the samples it holds),
    then the mean over all samples; with nan_inf_filter (logging_nan_inf_filter, on by default) a batch whose loss
    is not finite is left out, as Transformers leaves it out, unless every batch's is."""

    loss_sum: float = 0.0  # finite batch losses times their samples, in float64 as the sums over ranks are
    samples: float = 0.0  # of the batches with a finite loss (batches without labels have none)
    bad_sum: float = 0.0  # the same for the batches whose loss is nan or inf
    bad_samples: float = 0.0
    predictions: list[Any] = dataclasses.field(default_factory=list)  # a batch's: an array, or a tuple of them
    dealt: bool = True  # its loader read the samples evaluation.shard dealt this rank (reads), in that order
    labels: list[np.ndarray | tuple[np.ndarray, ...]] = dataclasses.field(default_factory=list)
    inputs: list[np.ndarray] = dataclasses.field(default_factory=list)  # include_for_metrics "inputs"
    losses: list[np.ndarray] = dataclasses.field(default_factory=list)  # include_for_metrics "loss"
    step_metrics: dict[str, Any] | None = None  # batch_eval_metrics: what compute_metrics returned at the last step
    per_step: bool = False  # eval_do_concat_batches=False: the predictions as a list, one array per step
    batch_size: int = 1  # of the batches shard dealt (per_step checks that the loader kept them)
    nan_inf_filter: bool = True  # leave the batches whose loss is nan or inf out of the mean loss


# (loss, logits, labels, samples, the batch's main model input): prediction_step's, and what more evaluation needs
ForwardResult = tuple[torch.Tensor | None, Any, Any, int, Any]
Forward = Callable[[Any], ForwardResult]


def accumulate(batches: Iterable, forward: Forward, want_predictions: bool,
               preprocess: Callable[[Any, Any], Any] | None = None,
               include: Collection[str] = (), each: Callable[[Part], None] | None = None) -> Part:
    """Run `forward` on every batch; sum the losses weighted by samples (a loss of None: a batch without labels,
    left out), keep logits (a tensor or a tuple of them, nested; or what `preprocess(logits, labels)` makes of
    them: Transformers' preprocess_logits_for_metrics, given the same) and labels (None: none) if wanted, and what
    `include` names (Transformers' include_for_metrics): "inputs", the main model input, and "loss", the batch's
    loss once per sample. `each`: called with the part after every batch (ddpkit.trainer.batch_metrics' steps)."""
    part = Part()
    for batch in batches:
        loss, logits, labels, samples, main_input = forward(batch)
        if loss is not None:
            value = loss.detach().double().mean().item()  # a prediction_step's loss may be per sample
            if math.isfinite(value):
                part.loss_sum, part.samples = part.loss_sum + value * samples, part.samples + samples
            else:
                part.bad_sum, part.bad_samples = part.bad_sum + value * samples, part.bad_samples + samples
        if want_predictions:
            maker = "prediction_step" if preprocess is None else "preprocess_logits_for_metrics"
            part.predictions.append(_host(logits if preprocess is None else preprocess(logits, labels), maker))
            if labels is not None:
                part.labels.append(_numpy(labels))
            if "inputs" in include and main_input is not None:
                part.inputs.append(_numpy(main_input))
            if "loss" in include and loss is not None:
                part.losses.append(_numpy(loss.detach().mean().reshape(1).repeat(samples)))
        if each is not None:
            each(part)
    return part


def _host(logits: Any, maker: str) -> Any:
    """A batch's predictions on the host, as Transformers' evaluation_loop keeps them: a tensor as an array in the
    model's dtype (numpy has no bfloat16, which becomes float32), at least 1-d; a tuple (or list) as a tuple."""
    if isinstance(logits, (list, tuple)) and logits:
        return tuple(_host(one, maker) for one in logits)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{maker} returned {type(logits).__name__} for the logits; ddpkit gathers a tensor a batch, "
                        "or a tuple of them: return tensors (logits.argmax(-1), say), or leave an output that is none "
                        "out with ignore_keys")
    logits = logits.detach()
    return np.atleast_1d((logits.float() if logits.dtype == torch.bfloat16 else logits).cpu().numpy())


def reads(loader: Any, dataset: Any, indices: list[int]) -> bool:
    """Whether `loader` reads `indices` of `dataset`, in order, as far as it tells: a loader of `dataset` whose
    batch sampler (or sampler) yields other indices does not; one of another dataset (a Subset), without a
    sampler (a wrapper) or with one that cannot be read twice or has no length is taken at its word."""
    if getattr(loader, "dataset", None) is not dataset:
        return True
    batches, sampler = getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)
    try:  # the length first: an endless sampler is no list to compare
        if batches is not None:
            return len(batches) >= 0 and [int(i) for batch in batches for i in batch] == list(indices)
        return sampler is None or len(sampler) == len(indices) and [int(i) for i in sampler] == list(indices)
    except (TypeError, ValueError):  # no length, or not indices: it cannot tell
        return True


def over_ranks(comm: Comm, part: Part, indices: list[int], prefix: str,
               compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None,
               device: torch.device) -> dict[str, float]:
    """evaluate's metrics, as Transformers' evaluation_loop gives them: {prefix}_loss over every rank's samples
    where some batch had a loss, compute_metrics' results (prefixed) where the batches had labels; for batches
    without labels neither (the caller adds the speed). The predictions are gathered only for compute_metrics."""
    if compute_metrics is None:
        return _loss_metrics(comm, part, prefix, device)
    return predictions_over_ranks(comm, part, indices, prefix, compute_metrics, device)[1]


def predictions_over_ranks(comm: Comm, part: Part, indices: list[int], prefix: str,
                           compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None,
                           device: torch.device) -> tuple[EvalPrediction, dict[str, float]]:
    """predict's: every rank's predictions in dataset order, on every rank; {prefix}_loss where some batch had
    labels; compute_metrics' results (prefixed) where there are labels to compare with."""
    prediction = gather_predictions(comm, part, indices)
    metrics = _loss_metrics(comm, part, prefix, device)
    # Whether there are labels is every rank's alike (gathered), so every rank calls compute_metrics or none does.
    if compute_metrics is not None and prediction.label_ids is not None:
        metrics.update(prefixed(compute_metrics(prediction), prefix))
    return prediction, metrics


def _loss_metrics(comm: Comm, part: Part, prefix: str, device: torch.device) -> dict[str, float]:
    """{prefix}_loss, or nothing where no batch on any rank had a loss (no labels): one collective on every rank."""
    loss, items = _loss_over_ranks(comm, part, prefix, device)
    return {f"{prefix}_loss": loss} if items else {}


def _loss_over_ranks(comm: Comm, part: Part, prefix: str, device: torch.device) -> tuple[float, float]:
    """The mean loss over every rank's samples (Part says how), and how many samples had a loss."""
    loss_sum, samples, bad_sum, bad_samples = sum_over_ranks(
        comm, [part.loss_sum, part.samples, part.bad_sum, part.bad_samples], f"{prefix} loss", device)
    if not part.nan_inf_filter and bad_samples:  # every batch's loss in the mean: nan or inf, as it is
        return (loss_sum + bad_sum) / (samples + bad_samples), samples + bad_samples
    if samples:
        return loss_sum / samples, samples
    return (bad_sum / bad_samples if bad_samples else 0.0), bad_samples


def prefixed(found: dict[str, Any], prefix: str) -> dict[str, Any]:
    """compute_metrics' results as Transformers reports them: each name prefixed unless it is already, numpy
    scalars and one-element tensors as Python numbers (inside lists and dicts too), any other value as it is."""
    return {(k if str(k).startswith(f"{prefix}_") else f"{prefix}_{k}"): _plain(v) for k, v in found.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return value.item()
    return value


def _numpy(labels: torch.Tensor | tuple[torch.Tensor, ...]) -> np.ndarray | tuple[np.ndarray, ...]:
    if isinstance(labels, tuple):
        return tuple(_numpy(one) for one in labels)
    return (labels.float() if labels.dtype == torch.bfloat16 else labels).detach().cpu().numpy()


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    """Concatenated along the samples. Batches padded to their own longest sequence (token classification, a
    language model's logits) differ in their second dimension: as Transformers concatenates them, the shorter ones
    are padded there with -100 to the longest."""
    if arrays[0].ndim < 2 or len({a.shape[1] for a in arrays}) == 1:
        return np.concatenate(arrays)
    longest = max(a.shape[1] for a in arrays)
    joined = np.full((sum(len(a) for a in arrays), longest, *arrays[0].shape[2:]), model_io.IGNORE_INDEX,
                     dtype=np.result_type(*arrays))
    start = 0
    for a in arrays:
        joined[start:start + len(a), :a.shape[1]] = a
        start += len(a)
    return joined


def joined(pieces: list[Any], order: np.ndarray | None = None) -> Any:
    """Arrays (or tuples of arrays, nested: several label names or model outputs) concatenated along the samples,
    element by element, as Transformers' nested_concat joins them, then put in `order`."""
    if len({len(piece) if isinstance(piece, tuple) else None for piece in pieces}) > 1:
        raise ValueError(f"the batches' predictions (or labels) differ in structure: some are {_structures(pieces)}; "
                         "a model must give every batch the same outputs")
    if isinstance(pieces[0], tuple):
        return tuple(joined([piece[i] for piece in pieces], order) for i in range(len(pieces[0])))
    whole = _concat(pieces)
    return whole if order is None else whole[order]


def _structures(pieces: list[Any]) -> str:
    kinds = sorted({len(piece) if isinstance(piece, tuple) else 0 for piece in pieces})
    return ", some ".join(f"a tuple of {n}" if n else "one array" for n in kinds)


def _leaves(value: Any) -> Iterator[np.ndarray]:
    if isinstance(value, tuple):
        for one in value:
            yield from _leaves(one)
    else:
        yield value


def samples_of(batch: Any) -> int:
    """The samples of a batch's predictions or labels: its (first) array's first dimension."""
    return len(next(_leaves(batch)))


def gather_predictions(comm: Comm, part: Part, indices: list[int]) -> EvalPrediction:
    """Every rank's predictions (and labels), in dataset order, on every rank: each one array (a tuple of them, for
    several outputs or label names), or with part.per_step (Transformers' eval_do_concat_batches=False) a list of
    those per step, a step being one batch of every rank (batch k is rank k % R's: see shard), padded within the
    step only. Each rank's batches are joined after the gather, where a failure is every rank's alike."""
    local = (indices, *(pieces or None for pieces in (part.predictions, part.labels)), part.dealt,
             *(pieces or None for pieces in (part.inputs, part.losses)))
    shards = gather_objects(comm, local, "evaluation predictions")
    check_outputs([s[1] for s in shards])
    _check_shards(shards)
    if part.per_step:
        _check_batches(shards, part.batch_size)
        return EvalPrediction(*(_steps([s[i] for s in shards]) for i in (1, 2, 4, 5)))
    order = np.argsort(np.concatenate([np.asarray(s[0], dtype=np.int64) for s in shards]))
    # Whether there are labels (inputs, losses) is every rank's question alike: a rank without samples has none.
    preds, labels, inputs, losses = ([b for s in shards if s[i] is not None for b in s[i]] for i in (1, 2, 4, 5))
    return EvalPrediction(joined(preds, order), *(joined(x, order) if x else None for x in (labels, inputs, losses)))


def _steps(ranks: list[list[Any] | None]) -> list[Any] | None:
    """Each rank's batches, one list per rank, as one array per step: the s-th batch of every rank, rank order."""
    batches = [r for r in ranks if r]
    if not batches:
        return None
    return [joined([mine[s] for mine in batches if s < len(mine)]) for s in range(max(map(len, batches)))]


def _check_batches(shards: list[tuple], batch_size: int) -> None:
    """Per step, the s-th batch of every rank: each rank's loader must have batched its samples as dealt (batches of
    batch_size, only the dataset's last one short), or a step would mix other samples (every rank raises alike)."""
    for rank, (indices, predictions, *_) in enumerate(shards):
        made = [samples_of(batch) for batch in predictions or ()]
        dealt = [len(indices[i:i + batch_size]) for i in range(0, len(indices), batch_size)]
        if predictions is not None and made != dealt:
            raise ValueError(f"rank {rank} made batches of {made} samples where ddpkit dealt it {dealt}: with "
                             "eval_do_concat_batches=False each step is one batch of every rank, so an overridden "
                             "get_eval_dataloader or get_test_dataloader must keep super()'s batches")


def _count(gathered: list[Any] | None) -> int:
    """The samples of a rank's gathered predictions or labels, a list of its batches' (each an array or a tuple)."""
    return 0 if gathered is None else sum(map(samples_of, gathered))


def check_outputs(ranks: list[list[Any] | None]) -> None:
    """Several outputs are gathered sample by sample, over the batches and the ranks, as Transformers concatenates
    them: each of a batch's must have a row per sample (`ranks`: each rank's batches of predictions, gathered, so
    that every rank raises alike)."""
    for rank, batches in enumerate(ranks):
        for batch in batches or ():
            rows = [len(leaf) for leaf in _leaves(batch)]
            if len(set(rows)) > 1:
                raise ValueError(f"rank {rank} predicted a batch whose outputs have {rows} rows: ddpkit gathers each "
                                 "output along its first dimension, a row per sample; leave an output without "
                                 "one out of the predictions (ignore_keys), or override prediction_step")


def _check_shards(shards: list[tuple]) -> None:
    """A prediction for every sample dealt to a rank, and labels for every prediction or for none (each rank sees
    every shard, so all raise alike, no hang)."""
    counts = [(_count(s[1]), _count(s[2])) for s in shards]
    for rank, ((indices, _, _, dealt, *_), (predictions, _)) in enumerate(zip(shards, counts)):
        if predictions != len(indices) or not dealt:
            read = f"predicted {predictions} samples, not" if predictions != len(indices) else "read other samples than"
            raise ValueError(f"rank {rank} {read} the {len(indices)} ddpkit dealt it, in their order: an overridden "
                             "get_eval_dataloader or get_test_dataloader must keep super()'s sampler (every sample "
                             "once over the ranks, in dataset order)")
    if any(labels for _, labels in counts) and any(labels != predictions for predictions, labels in counts):
        raise ValueError("some batches of the dataset have labels and some do not: give every sample its labels "
                         "(for a loss and compute_metrics) or none (predictions only)")


__all__ = ["Part", "accumulate", "reads", "can_return_loss", "check_outputs", "gather_predictions", "joined",
           "label_names_of", "labels_named", "over_ranks", "predictions_over_ranks", "prefixed", "samples_of", "shard"]
