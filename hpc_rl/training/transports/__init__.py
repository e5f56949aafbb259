"""The trainer halves of the weight transports, one module per transport (the controller halves are
`hpc_rl.controller.transports.<same name>`; the layer order keeps torch out of the controller, so the two
halves live in the two packages under the same module name):

    broadcast   SyncWeightsCommand, AbortWeightGroupCommand -> rank 0 joins the group and broadcasts buckets
    disk        DiskWeightsCommand                          -> every rank writes the HF directory
    colocated   ColocatedSyncCommand                        -> every rank posts its buckets to its GPU's engine
    lora        LoraAdapterCommand                          -> every rank writes only the LoRA adapter (PEFT directory)

`TrainerCommands` (training/commands.py) hands each command to its transport; `base` holds what they share.
"""
