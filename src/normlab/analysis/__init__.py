"""Analysis tools: theory predictions and measurements on recorded activations."""

from normlab.analysis.collapse import (
    Perturbation,
    find_sparse_rows,
    measure_collapse,
    perturbed_accuracy,
    perturbed_predictor,
)
from normlab.analysis.data import EvalData, attention_sites
from normlab.analysis.interference import interference_probe, synthetic_interference
from normlab.analysis.norms import norm_ratios, norm_spread
from normlab.analysis.report import analyze_run

__all__ = [
    "EvalData",
    "Perturbation",
    "analyze_run",
    "attention_sites",
    "find_sparse_rows",
    "interference_probe",
    "measure_collapse",
    "norm_ratios",
    "norm_spread",
    "perturbed_accuracy",
    "perturbed_predictor",
    "synthetic_interference",
]
