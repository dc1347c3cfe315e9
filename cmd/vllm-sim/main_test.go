package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/vllmsim"
)

func noEnv(string) string { return "" }

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestParseFlagsDefaults(t *testing.T) {
	o, err := parseFlags(nil, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := vllmsim.DefaultConfig()
	want.Addr = "127.0.0.1:8000"
	if o.cfg.Addr != want.Addr || o.cfg.MaxNumSeqs != want.MaxNumSeqs || o.cfg.SchedulingPolicy != vllmsim.PolicyFCFS ||
		!o.cfg.EnablePrefixCaching || o.cfg.TimeScale != 1 || o.cfg.Model != vllmsim.DefaultModel {
		t.Errorf("defaults: %+v", o.cfg)
	}
}

func TestParseFlagsVLLMNames(t *testing.T) {
	o, err := parseFlags([]string{
		"--host", "0.0.0.0", "--port", "9000", "--model", "m", "--served-model-name", "a,b",
		"--max-num-seqs", "8", "--max-model-len", "16k", "--num-gpu-blocks-override", "2048", "--block-size", "32",
		"--scheduling-policy", "priority", "--no-enable-prefix-caching", "--max-num-batched-tokens", "4096",
		"--max-num-queued-reqs", "64", "--max-num-queued-tokens", "32k", "--long-prefill-token-threshold", "1024",
		"--api-key", "sk", "--prefill-tokens-per-second", "20000", "--decode-step-base", "8ms",
		"--decode-step-per-seq", "50us", "--time-scale", "10", "--seed", "7", "--mean-output-tokens", "100",
		"--ignore-eos", "--embedding-dim", "16", "--fault-status", "503", "--fault-probability", "0.1",
		"--fault-retry-after", "2s", "--fault-delay", "5ms", "--fault-cut-after", "4", "--fault-reset-probability", "0.01",
	}, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c := o.cfg
	f := c.Faults
	switch {
	case c.Addr != "0.0.0.0:9000", c.Model != "m", strings.Join(c.ServedModelNames, ",") != "a,b",
		c.MaxNumSeqs != 8, c.MaxModelLen != 16000, c.NumGPUBlocks != 2048, c.BlockSize != 32,
		c.SchedulingPolicy != vllmsim.PolicyPriority, c.EnablePrefixCaching, c.MaxNumBatchedTokens != 4096,
		c.MaxNumQueuedReqs != 64, c.MaxNumQueuedTokens != 32000, c.LongPrefillTokenThreshold != 1024,
		c.APIKey != "sk", c.PrefillTokensPerSecond != 20000, c.DecodeStepBase != 8*time.Millisecond,
		c.DecodeStepPerSeq != 50*time.Microsecond, c.TimeScale != 10, c.Seed != 7, c.MeanOutputTokens != 100,
		!c.IgnoreEOS, c.EmbeddingDim != 16, f.Status != 503, f.Probability != 0.1, f.RetryAfter != 2*time.Second,
		f.Delay != 5*time.Millisecond, f.CutAfterChunks != 4, f.ResetProbability != 0.01:
		t.Errorf("parsed %+v", c)
	}
}

// Environment variables fill the flags not given; the command line wins;
// the API key also falls back to vLLM's VLLM_API_KEY.
func TestParseFlagsEnvironment(t *testing.T) {
	env := envOf(map[string]string{
		"VLLM_SIM_MAX_NUM_SEQS":      "12",
		"VLLM_SIM_TIME_SCALE":        "50",
		"VLLM_SIM_SCHEDULING_POLICY": "priority",
		"VLLM_API_KEY":               "sk-env",
	})
	o, err := parseFlags([]string{"--time-scale", "5"}, env, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.cfg.MaxNumSeqs != 12 || o.cfg.TimeScale != 5 || o.cfg.SchedulingPolicy != vllmsim.PolicyPriority || o.cfg.APIKey != "sk-env" {
		t.Errorf("parsed %+v", o.cfg)
	}
}

// Every problem is reported at once, environment included.
func TestParseFlagsReportsEveryProblem(t *testing.T) {
	env := envOf(map[string]string{"VLLM_SIM_BLOCK_SIZE": "sixteen"})
	_, err := parseFlags([]string{"--max-num-seqs", "0", "--scheduling-policy", "lifo", "--time-scale", "-1",
		"--port", "70000", "--log-level", "loud", "--fault-status", "200"}, env, io.Discard)
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"VLLM_SIM_BLOCK_SIZE", "max-num-seqs", "scheduling-policy", "time-scale", "port",
		"log-level", "fault-status"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %s:\n%v", want, err)
		}
	}
	if _, err := parseFlags([]string{"--enable-prefix-caching", "--no-enable-prefix-caching"}, noEnv, io.Discard); err == nil {
		t.Error("contradicting prefix-caching flags accepted")
	}
	if _, err := parseFlags([]string{"extra"}, noEnv, io.Discard); err == nil {
		t.Error("positional argument accepted")
	}
}

func TestParseHumanInt(t *testing.T) {
	for in, want := range map[string]int{"8192": 8192, "32k": 32000, "1K": 1024, "1m": 1000000, "1M": 1 << 20, "2.5k": 2500, "0": 0} {
		if got, err := parseHumanInt(in); err != nil || got != want {
			t.Errorf("parseHumanInt(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "abc", "1x", "k", "1.5K", "0.0001k"} {
		if _, err := parseHumanInt(in); err == nil {
			t.Errorf("parseHumanInt(%q) accepted", in)
		}
	}
}

func TestRunHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, noEnv, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "-max-num-seqs") || !strings.Contains(out.String(), "-scheduling-policy") {
		t.Errorf("usage: %s", out.String())
	}
}

// syncBuffer is a bytes.Buffer safe for the logger and the test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// run serves until its context is done, logging its URL to stdout.
func TestRunServes(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var out syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--port", "0", "--time-scale", "100", "--max-num-seqs", "4"}, noEnv, &out)
	}()
	re := regexp.MustCompile(`url=(http://\S+)`)
	var url string
	for deadline := time.Now().Add(10 * time.Second); url == ""; {
		if m := re.FindStringSubmatch(out.String()); m != nil {
			url = m[1]
		} else if time.Now().After(deadline) {
			t.Fatalf("no URL logged:\n%s", out.String())
		} else {
			time.Sleep(5 * time.Millisecond)
		}
	}
	client := &http.Client{Transport: &http.Transport{}}
	resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"hello","max_tokens":3}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"completion_tokens":3`) {
		t.Errorf("completion: %d %s", resp.StatusCode, body)
	}
	client.CloseIdleConnections()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after cancel")
	}
}

func TestRunRejectsBadConfig(t *testing.T) {
	if err := run(context.Background(), []string{"--max-num-seqs", "-1"}, noEnv, io.Discard); err == nil {
		t.Error("run accepted --max-num-seqs -1")
	}
}
