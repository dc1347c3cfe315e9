package upstream

import (
	"bufio"
	"bytes"
	"context"
	"hash/fnv"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Engine metrics (docs/routing.md, "engine_load"): each proxy polls the
// /metrics of the engines of the model groups whose strategy is
// engine_load, on a short interval, and keeps the last sample of each. A
// sample older than the maximum age is ignored: the strategy then uses
// the fleet-wide in-flight count instead, so a frozen, slow or missing
// metrics endpoint never holds a request back (the poll runs beside
// dispatch, never in front of it).
const (
	DefaultEngineMetricsInterval = time.Second
	DefaultEngineMetricsMaxAge   = 5 * time.Second
	// maxMetricsBody bounds the bytes of one /metrics answer read; vLLM's
	// whole page is tens of KiB.
	maxMetricsBody = 1 << 20
)

// The vLLM series the poller reads.
const (
	metricRunning = "vllm:num_requests_running"
	metricWaiting = "vllm:num_requests_waiting"
	metricKVUsage = "vllm:kv_cache_usage_perc"
)

// EngineSample is one poll of an engine's /metrics: requests running and
// waiting (summed over the page's label sets, e.g. several engines behind
// one server) and the KV-cache usage (the largest, a fraction in [0, 1]).
type EngineSample struct {
	Running, Waiting, KVUsage float64
	// At is when a page with these values first arrived. A page that
	// comes back byte for byte the same keeps the At of its first
	// arrival: an engine serving anything changes its counters and
	// histograms with every request, so an unchanged page is either an
	// idle engine (whose fallback, the fleet-wide in-flight count, is as
	// good) or a frozen exporter, whose values must age out.
	At time.Time
}

// EngineLoad holds a deployment's last engine sample.
type EngineLoad struct {
	last    atomic.Pointer[EngineSample]
	polling atomic.Bool
	// page is the hash of the last page read (the poller's goroutine of
	// this deployment only: one poll at a time).
	page uint64
}

// Fresh returns the last sample if it is at most maxAge old at now.
func (e *EngineLoad) Fresh(now time.Time, maxAge time.Duration) (EngineSample, bool) {
	s := e.last.Load()
	if s == nil || now.Sub(s.At) > maxAge {
		return EngineSample{}, false
	}
	return *s, true
}

// MetricsURL returns the /metrics URL of an API base (".../v1"; vLLM
// serves /metrics at its root, like /health).
func MetricsURL(apiBase string) string {
	b := strings.TrimSuffix(apiBase, "/")
	b = strings.TrimSuffix(b, "/v1")
	return b + "/metrics"
}

// MetricsTarget is one engine to poll.
type MetricsTarget struct {
	ID, APIBase string
	// Credential, when set, is sent as a bearer token (engines that guard
	// /metrics with their API key).
	Credential string
}

// MetricsPoller polls engines' /metrics (a component: Run). A poll still
// running when the next is due is not doubled: a hanging endpoint costs
// one goroutine, never a queue of them, and the round never waits for it.
type MetricsPoller struct {
	// Targets returns the engines to poll now.
	Targets func() []MetricsTarget
	States  *States
	Client  *http.Client
	// Interval between polls (zero: DefaultEngineMetricsInterval); each
	// poll is bounded by it too.
	Interval time.Duration
	// OnResult is told of every poll's outcome (metrics), may be nil.
	OnResult func(id string, ok bool)

	wg sync.WaitGroup
}

// Run polls every target each interval until ctx ends (nil then).
func (p *MetricsPoller) Run(ctx context.Context) error {
	if p.Interval <= 0 {
		p.Interval = DefaultEngineMetricsInterval
	}
	t := time.NewTicker(p.Interval)
	defer t.Stop()
	defer p.wg.Wait()
	for {
		for _, tg := range p.Targets() {
			e := &p.States.Get(tg.ID).Engine
			if !e.polling.CompareAndSwap(false, true) {
				continue // the previous poll still runs
			}
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				defer e.polling.Store(false)
				s, sum, ok := p.poll(ctx, tg)
				if ok && (sum != e.page || e.last.Load() == nil) {
					e.page = sum
					e.last.Store(&s)
				}
				if p.OnResult != nil && ctx.Err() == nil {
					p.OnResult(tg.ID, ok)
				}
			}()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (p *MetricsPoller) poll(ctx context.Context, tg MetricsTarget) (EngineSample, uint64, bool) {
	pctx, cancel := context.WithTimeout(ctx, p.Interval)
	defer cancel()
	req, err := http.NewRequestWithContext(pctx, http.MethodGet, MetricsURL(tg.APIBase), nil)
	if err != nil {
		return EngineSample{}, 0, false
	}
	if tg.Credential != "" {
		req.Header.Set("Authorization", "Bearer "+tg.Credential)
	}
	resp, err := p.Client.Do(req)
	if err != nil {
		return EngineSample{}, 0, false
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return EngineSample{}, 0, false
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxMetricsBody))
	if err != nil {
		return EngineSample{}, 0, false
	}
	s, ok := ParseEngineMetrics(body)
	s.At = time.Now()
	h := fnv.New64a()
	_, _ = h.Write(body)
	return s, h.Sum64(), ok
}

// ParseEngineMetrics reads the vLLM load series from a Prometheus text
// page; ok is false when the page has none of running and waiting (not a
// vLLM page, or cut short). Unparsable lines are skipped.
func ParseEngineMetrics(page []byte) (s EngineSample, ok bool) {
	sc := bufio.NewScanner(bytes.NewReader(page))
	sc.Buffer(make([]byte, 0, 4096), 64<<10)
	var sawRun, sawWait bool
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		name, v, good := sampleLine(line)
		if !good {
			continue
		}
		switch name {
		case metricRunning:
			s.Running += v
			sawRun = true
		case metricWaiting:
			s.Waiting += v
			sawWait = true
		case metricKVUsage:
			s.KVUsage = max(s.KVUsage, min(v, 1))
		}
	}
	return s, sawRun || sawWait
}

// sampleLine splits `name{labels} value [timestamp]` into the name and a
// finite, non-negative value.
func sampleLine(line []byte) (string, float64, bool) {
	i := bytes.IndexAny(line, "{ ")
	if i <= 0 {
		return "", 0, false
	}
	name := string(line[:i])
	rest := line[i:]
	if rest[0] == '{' {
		j := bytes.LastIndexByte(rest, '}')
		if j < 0 {
			return "", 0, false
		}
		rest = rest[j+1:]
	}
	f := strings.Fields(string(rest))
	if len(f) == 0 {
		return "", 0, false
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return "", 0, false
	}
	return name, v, true
}

// Store sets the deployment's last sample (tests and the poller).
func (e *EngineLoad) Store(s EngineSample) { e.last.Store(&s) }
