package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"strconv"
	"strings"

	"github.com/sluicegw/sluice/e2e/vllmsim"
)

// envPrefix prefixes the environment variable of every flag.
const envPrefix = "VLLM_SIM_"

// options is the parsed command line.
type options struct {
	cfg       vllmsim.Config
	logLevel  string
	logFormat string
	help      bool
}

// humanInt is an integer flag that also takes vLLM's human-readable forms:
// 32k = 32000, 1K = 1024, 1m = 1000000, 1M = 1048576, 2.5k = 2500.
type humanInt struct{ p *int }

// String implements flag.Value.
func (h humanInt) String() string {
	if h.p == nil {
		return "0"
	}
	return strconv.Itoa(*h.p)
}

// Set implements flag.Value.
func (h humanInt) Set(s string) error {
	n, err := parseHumanInt(s)
	if err != nil {
		return err
	}
	*h.p = n
	return nil
}

func parseHumanInt(s string) (int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, errors.New("empty number")
	}
	mult := 1.0
	binary := false
	switch last := s[len(s)-1]; last {
	case 'k':
		mult = 1e3
	case 'm':
		mult = 1e6
	case 'g':
		mult = 1e9
	case 'K':
		mult, binary = 1<<10, true
	case 'M':
		mult, binary = 1<<20, true
	case 'G':
		mult, binary = 1<<30, true
	}
	num := s
	if mult != 1 {
		num = s[:len(s)-1]
	}
	if n, err := strconv.Atoi(num); err == nil {
		return n * int(mult), nil
	}
	if binary {
		return 0, fmt.Errorf("%q: binary suffixes need a whole number", s)
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("%q is not a number (forms: 8192, 32k, 1K, 2.5k)", s)
	}
	v := f * mult
	if v != math.Trunc(v) {
		return 0, fmt.Errorf("%q is not a whole number of tokens", s)
	}
	return int(v), nil
}

// listFlag is a comma-separated (or repeated) list of names.
type listFlag struct{ p *[]string }

// String implements flag.Value.
func (l listFlag) String() string {
	if l.p == nil {
		return ""
	}
	return strings.Join(*l.p, ",")
}

// Set implements flag.Value; values accumulate.
func (l listFlag) Set(s string) error {
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			*l.p = append(*l.p, v)
		}
	}
	return nil
}

// parseFlags parses args, with VLLM_SIM_* (and VLLM_API_KEY) from getenv
// for the flags not given, and validates the result, reporting every
// problem at once. With -h it prints the usage to stdout and sets help.
func parseFlags(args []string, getenv func(string) string, stdout io.Writer) (options, error) {
	o := options{cfg: vllmsim.DefaultConfig(), logLevel: "info", logFormat: "text"}
	c := &o.cfg
	fs := flag.NewFlagSet("vllm-sim", flag.ContinueOnError)
	fs.SetOutput(stdout)
	host, port := "127.0.0.1", 8000
	var noPrefixCaching bool
	policy := string(c.SchedulingPolicy)

	fs.StringVar(&host, "host", host, "address to listen on")
	fs.IntVar(&port, "port", port, "port to listen on (0: any free port)")
	fs.StringVar(&c.Model, "model", c.Model, "model name")
	fs.Var(listFlag{&c.ServedModelNames}, "served-model-name",
		"names the API accepts, comma-separated; the first is used in responses (default: --model)")
	fs.StringVar(&c.APIKey, "api-key", "", "require this bearer token on /v1 routes (also VLLM_API_KEY)")
	fs.IntVar(&c.MaxNumSeqs, "max-num-seqs", c.MaxNumSeqs, "maximum number of running sequences")
	fs.Var(humanInt{&c.MaxModelLen}, "max-model-len", "maximum prompt plus output tokens")
	fs.IntVar(&c.NumGPUBlocks, "num-gpu-blocks", c.NumGPUBlocks, "number of KV-cache blocks, including vLLM's null block")
	fs.IntVar(&c.NumGPUBlocks, "num-gpu-blocks-override", c.NumGPUBlocks, "alias of --num-gpu-blocks")
	fs.IntVar(&c.BlockSize, "block-size", c.BlockSize, "tokens per KV-cache block")
	fs.StringVar(&policy, "scheduling-policy", policy, "fcfs or priority")
	fs.BoolVar(&c.EnablePrefixCaching, "enable-prefix-caching", c.EnablePrefixCaching, "automatic prefix caching")
	fs.BoolVar(&noPrefixCaching, "no-enable-prefix-caching", false, "disable automatic prefix caching")
	fs.Var(humanInt{&c.MaxNumBatchedTokens}, "max-num-batched-tokens", "token budget of one engine step")
	fs.IntVar(&c.LongPrefillTokenThreshold, "long-prefill-token-threshold", 0,
		"cap on the tokens one request prefills per step (0: none)")
	fs.IntVar(&c.MaxNumQueuedReqs, "max-num-queued-reqs", 0,
		"answer 503 when this many requests are unfinished (0: no limit)")
	fs.Var(humanInt{&c.MaxNumQueuedTokens}, "max-num-queued-tokens",
		"answer 503 when the prompts still in prefill reach this many tokens (0: no limit)")
	fs.Float64Var(&c.PrefillTokensPerSecond, "prefill-tokens-per-second", c.PrefillTokensPerSecond,
		"prefill throughput of the simulated GPU")
	fs.DurationVar(&c.DecodeStepBase, "decode-step-base", c.DecodeStepBase, "fixed cost of every engine step")
	fs.DurationVar(&c.DecodeStepPerSeq, "decode-step-per-seq", c.DecodeStepPerSeq,
		"extra cost of every sequence in a step's batch")
	fs.Float64Var(&c.TimeScale, "time-scale", c.TimeScale, "simulated seconds per wall-clock second")
	fs.Uint64Var(&c.Seed, "seed", c.Seed, "seed of generated text, output lengths and fault draws")
	fs.IntVar(&c.MeanOutputTokens, "mean-output-tokens", c.MeanOutputTokens,
		"mean length of answers the model ends by itself")
	fs.BoolVar(&c.IgnoreEOS, "ignore-eos", false, "always generate max_tokens")
	fs.IntVar(&c.EmbeddingDim, "embedding-dim", c.EmbeddingDim, "length of embedding vectors")
	fs.IntVar(&c.Faults.Status, "fault-status", 0, "answer requests with this HTTP status (0: off)")
	fs.Float64Var(&c.Faults.Probability, "fault-probability", 0, "fraction of requests that get --fault-status (0: all)")
	fs.DurationVar(&c.Faults.RetryAfter, "fault-retry-after", c.Faults.RetryAfter,
		"Retry-After of 429 and 503 faults (0: no header)")
	fs.DurationVar(&c.Faults.Delay, "fault-delay", 0, "wall-clock delay added to every request")
	fs.IntVar(&c.Faults.CutAfterChunks, "fault-cut-after", 0, "drop every stream after this many chunks (0: off)")
	fs.Float64Var(&c.Faults.ResetProbability, "fault-reset-probability", 0,
		"fraction of new connections reset on accept")
	fs.StringVar(&o.logLevel, "log-level", o.logLevel, "debug, info, warn or error")
	fs.StringVar(&o.logFormat, "log-format", o.logFormat, "text or json")

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			o.help = true
			return o, nil
		}
		return o, err
	}
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments: %q", fs.Args()))
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] {
			return
		}
		env := envPrefix + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		v := getenv(env)
		if v == "" && f.Name == "api-key" {
			env, v = "VLLM_API_KEY", getenv("VLLM_API_KEY")
		}
		if v == "" {
			return
		}
		if err := fs.Set(f.Name, v); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", env, err))
		}
	})
	if noPrefixCaching {
		if given["enable-prefix-caching"] && c.EnablePrefixCaching {
			errs = append(errs, errors.New("--enable-prefix-caching and --no-enable-prefix-caching contradict each other"))
		}
		c.EnablePrefixCaching = false
	}
	c.SchedulingPolicy = vllmsim.Policy(policy)
	if port < 0 || port > 65535 {
		errs = append(errs, fmt.Errorf("port must be in 0-65535, got %d", port))
	}
	c.Addr = net.JoinHostPort(host, strconv.Itoa(port))
	if _, err := parseLevel(o.logLevel); err != nil {
		errs = append(errs, err)
	}
	if o.logFormat != "text" && o.logFormat != "json" {
		errs = append(errs, fmt.Errorf("log-format must be text or json, got %q", o.logFormat))
	}
	if err := c.Validate(); err != nil {
		errs = append(errs, err)
	}
	return o, errors.Join(errs...)
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("log-level must be debug, info, warn or error, got %q", s)
	}
	return l, nil
}

// newLogger builds the process's logger.
func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	l, err := parseLevel(level)
	if err != nil {
		return nil, err
	}
	ho := &slog.HandlerOptions{Level: l}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, ho)), nil
	}
	return slog.New(slog.NewTextHandler(w, ho)), nil
}
