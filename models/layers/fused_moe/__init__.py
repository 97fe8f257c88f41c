"""Mixture-of-experts layers: FusedMoE, its router, kernels and expert placement."""

from models.layers.fused_moe.expert_map import ExpertParallelConfigError, ExpertPlacement, determine_expert_placement
from models.layers.fused_moe.expert_weights import ExpertWeightsLoader
from models.layers.fused_moe.layer import FusedMoE
from models.layers.fused_moe.moe_method import UnquantizedFusedMoEMethod
from models.layers.fused_moe.router import fused_topk

__all__ = ["ExpertParallelConfigError", "ExpertPlacement", "ExpertWeightsLoader", "FusedMoE",
           "UnquantizedFusedMoEMethod", "determine_expert_placement", "fused_topk"]
