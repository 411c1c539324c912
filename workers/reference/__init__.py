"""The reference executor: log pi_ref of the trained tokens, for the KL term (spec.roles.reference)."""
