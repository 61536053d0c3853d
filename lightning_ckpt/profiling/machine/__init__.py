"""The machine: its measured rates and the timings kept between runs."""
