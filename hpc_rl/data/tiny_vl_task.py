"""placeholder"""
VL_TASK_WORDS = ["what", "colour", "is", "the", "shape", "how", "many", "shapes", "are", "there", "?",
                 "red", "green", "blue", "yellow"]
