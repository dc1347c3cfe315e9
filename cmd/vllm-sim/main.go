// Command vllm-sim serves a simulated vLLM 0.29 engine behind its
// OpenAI-compatible API, for tests, demos and benchmarks of the gateway. See
// docs/vllm-sim.md and package e2e/vllmsim.
//
// Every flag can also be set by the environment variable VLLM_SIM_<FLAG>
// (upper case, dashes as underscores, e.g. VLLM_SIM_MAX_NUM_SEQS); a flag on
// the command line wins. The API key also falls back to VLLM_API_KEY, as in
// vLLM.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/sluicegw/sluice/e2e/vllmsim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "vllm-sim:", err)
		os.Exit(1)
	}
}

// run parses the command line, then serves until ctx is done.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	opts, err := parseFlags(args, getenv, stdout)
	if err != nil {
		return err
	}
	if opts.help {
		return nil
	}
	logger, err := newLogger(stdout, opts.logLevel, opts.logFormat)
	if err != nil {
		return err
	}
	srv, err := vllmsim.New(opts.cfg, logger)
	if err != nil {
		return err
	}
	return srv.Run(ctx)
}
