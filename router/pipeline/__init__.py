"""The request pipeline, a module per stage: service (the attempt loop), resolve, plan, wait, attempt, the mixed and PD strategies, dispatch and relay."""
