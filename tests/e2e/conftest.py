"""This tier's fixtures: the CRD installed ("crd") and the operator as a local process
("operator"), from `tests.support.operator`."""

from tests.support.operator import crd_installed, operator_process

__all__ = ["crd_installed", "operator_process"]
