"""regattn.models"""
from regattn.models.lm import LM_MIXERS, DecoderLM, LMConfig
