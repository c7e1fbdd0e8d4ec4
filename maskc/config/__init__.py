"""Masks in model configs: `MaskConfig`, config files (YAML / JSON / TOML) and
`MaskSpec` fields.
"""
