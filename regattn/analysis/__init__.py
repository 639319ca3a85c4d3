"""Mechanism diagnostics of trained models: COR, Corr, CPA, probe norm, stable ranks, scores."""
from regattn.analysis.diagnostics import analyze, layer_diagnostics, stable_rank, weight_ranks
