"""forge: recipe-driven builds of validated inference engines and Triton model repositories."""

__version__ = "0.1.0"
