// Command dev-load is the `sluice dev` demo of people and agents on one
// pool (make dev-load): it reads the running demo's state file, measures
// a chat probe alone, then runs coding-agent loops through the demo's
// agent key while the chat probe (every 0.5 s, the human key) keeps
// running, and prints the chat's time to first token and the agents'
// output tokens per second every few seconds until Ctrl-C or --duration.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sluicegw/sluice/e2e/load"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		fmt.Fprintln(os.Stderr, "dev-load:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("dev-load", flag.ContinueOnError)
	stateFile := fs.String("state-file", ".sluice/dev.json", "the state file `sluice dev` writes")
	model := fs.String("model", "qwen-30b", "model the demo serves")
	agents := fs.Int("agents", 12, "coding-agent loops on the agent key")
	prompt := fs.Int("agent-prompt-tokens", 20000, "an agent conversation's first prompt, in tokens")
	idle := fs.Duration("idle", 5*time.Second, "how long the chat probe runs alone first")
	ramp := fs.Duration("ramp", 20*time.Second, "the agents start spread over this long (their first prompts are not cached)")
	report := fs.Duration("report", 5*time.Second, "how often to print the figures")
	duration := fs.Duration("duration", 0, "stop after this long (0: at Ctrl-C)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	b, err := os.ReadFile(*stateFile)
	if err != nil {
		return fmt.Errorf("read the state file (is `make dev` running?): %w", err)
	}
	var st struct {
		ProxyURL string            `json:"proxy_url"`
		Keys     map[string]string `json:"keys"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("state file %s: %w", *stateFile, err)
	}
	if st.ProxyURL == "" || st.Keys["human"] == "" || st.Keys["agent"] == "" {
		return fmt.Errorf("state file %s has no proxy_url or human and agent keys", *stateFile)
	}
	if *duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *duration)
		defer cancel()
	}

	// The chat probe: every 0.5 s, a 300-token prompt, 100 tokens out.
	var mu sync.Mutex
	var ttfts []time.Duration
	refused := 0
	var seq atomic.Uint64
	probe := func() {
		d, _, ok := load.Chat(st.ProxyURL, st.Keys["human"], *model, 7_000_000+seq.Add(1), 300, 100)
		mu.Lock()
		defer mu.Unlock()
		if ok {
			ttfts = append(ttfts, d)
		} else {
			refused++
		}
	}
	take := func() ([]time.Duration, int) {
		mu.Lock()
		defer mu.Unlock()
		t, r := ttfts, refused
		ttfts, refused = nil, 0
		return t, r
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			wg.Add(1)
			go func() { defer wg.Done(); probe() }()
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()

	fmt.Fprintf(out, "dev-load: chat probe alone for %s (%s, model %s) ...\n", *idle, st.ProxyURL, *model)
	select {
	case <-time.After(*idle):
	case <-ctx.Done():
		return ctx.Err()
	}
	t, r := take()
	fmt.Fprintf(out, "chat alone:       TTFT p50 %-7s max %-7s (%d chats, %d refused)\n", pct(t, 50), pct(t, 100), len(t), r)

	var tokens atomic.Int64
	var errs atomic.Int64
	loop := load.Agent{Model: *model, Prompt: *prompt, Growth: 500, Output: 300, MaxPrompt: 29000}
	for i := range *agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-time.After(*ramp * time.Duration(i) / time.Duration(*agents)):
			case <-ctx.Done():
				return
			}
			loop.Run(ctx, st.ProxyURL, st.Keys["agent"], fmt.Sprintf("demo-agent-%d-%d", os.Getpid(), i), uint64(i+1)*100_000,
				func(_ []time.Time, n int) { tokens.Add(int64(n)) }, &errs)
		}()
	}
	fmt.Fprintf(out, "dev-load: %d agent loops starting over %s on the agent key (%d-token prompts growing each turn, 300-token answers); Ctrl-C stops\n",
		*agents, *ramp, *prompt)
	fmt.Fprintln(out, "dev-load: while agents prefill their first, uncached prompts, a chat shares engine steps with those prefills unless another engine has less prefill in flight (docs/traffic.md, \"Prefill in flight\")")
	tick := time.NewTicker(*report)
	defer tick.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case now := <-tick.C:
			t, r := take()
			n := tokens.Swap(0)
			fmt.Fprintf(out, "with %2d agents:   TTFT p50 %-7s max %-7s (%d chats, %d refused) | agents %5.0f output tokens/s, %d refused or failed\n",
				*agents, pct(t, 50), pct(t, 100), len(t), r, float64(n)/now.Sub(last).Seconds(), errs.Swap(0))
			last = now
		}
	}
}

// pct is the nearest-rank p-th percentile of d, rounded to milliseconds.
func pct(d []time.Duration, p float64) string {
	if len(d) == 0 {
		return "-"
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)].Round(time.Millisecond).String()
}
