"""The calculator tool of the tools quickstart (`configs/tools_quickstart.yaml`): a plain function with type hints
and a docstring, as TRL's GRPOTrainer takes tools (`tools=[multiply]`) and as `--tools` reads them."""


def multiply(a: int, b: int) -> int:
    """Multiplies two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
