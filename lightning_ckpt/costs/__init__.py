"""The plain data every stage shares: a step's measured costs (`block_costs`: `StepCost`,
`BlockCost`, `OpCost`), their fit in the batch size (`linear_fit.Profile`) and the machine's rates
(`machine_rates.MachineRates`). No torch here; nothing here imports another stage."""
