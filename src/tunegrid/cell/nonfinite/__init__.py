"""Non-finite values: where one came from (the failing step replayed with hooks), the fp16 fixes that keep
fp32 where fp16 overflows (fp32 islands, CPU fp16 matmuls summed in fp32), and a non-finite value injected on
purpose to check the diagnosis."""
