"""Worker-side executors of the built-in ops that need the runtime's engines and trainers
(``generate``, ``advantage``, ``train_step``); light ones live in their op's module."""
