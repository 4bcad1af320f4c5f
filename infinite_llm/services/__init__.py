"""Thin gRPC servicers over ``core/``, one subpackage per service (DESIGN.md §4)."""
