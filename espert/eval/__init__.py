"""Evaluation: sampling, pass@k / maj@k / histograms / progressions, reports and plots.

Public API::

    from espert.eval import TransformersSampler, VLLMSampler, Sampler
    from espert.eval import generate_samples, build_report, format_summary, write_plots
    from espert.eval import pass_at_k, maj_at_k, accuracy_histogram, answer_entropy
    from espert.eval.cli import add_eval_parser, add_analyze_parser
"""

from .metrics import (
    ACC_BIN_LABELS,
    SOLVE_RULES,
    accuracy_bin,
    accuracy_histogram,
    answer_entropy,
    k_values,
    maj_at_k,
    pass_at_k,
    solved,
)
from .plots import write_plots
from .report import build_report, compare, format_summary, model_metrics
from .runner import generate_samples, load_sample_files, parse_model_specs, write_outputs
from .samplers import Sampler, TransformersSampler, VLLMSampler, make_sampler
from .samples import group_by_model, load_samples, make_records, rescore, save_samples, score_records

__all__ = [
    "ACC_BIN_LABELS",
    "SOLVE_RULES",
    "accuracy_bin",
    "accuracy_histogram",
    "answer_entropy",
    "k_values",
    "maj_at_k",
    "pass_at_k",
    "solved",
    "write_plots",
    "build_report",
    "compare",
    "format_summary",
    "model_metrics",
    "generate_samples",
    "load_sample_files",
    "parse_model_specs",
    "write_outputs",
    "Sampler",
    "TransformersSampler",
    "VLLMSampler",
    "make_sampler",
    "group_by_model",
    "load_samples",
    "make_records",
    "rescore",
    "save_samples",
    "score_records",
]
