"""The lab's studies that train their own models (lab/studies.py's measure models a worker serves): RoPE scaling
types compared (`scaling`), NoPE and RoPE layers mixed (`hybrid`), and the training loop they share (`lm_train`).
Each trains, exports and serves in process, then measures through lab/studies.py; run as
`python -m lab.experiments.NAME` (make scaling-study, make hybrid-study)."""
