"""Deployment recipes for GLM-5.3-Flash (``recipes/*.yaml``), shipped inside the plugin as ``vllm_glm53._recipes``.

Read them through ``vllm_glm53.recipes``; this package holds data only.
"""
