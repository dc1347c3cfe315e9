package upstream

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Active health check defaults: each engine's /health every interval,
// each probe bounded by the timeout; UnhealthyThreshold consecutive
// failures take the deployment out, HealthyThreshold successes bring it
// back.
const (
	DefaultHealthCheckInterval  = 5 * time.Second
	DefaultHealthCheckTimeout   = time.Second
	DefaultUnhealthyThreshold   = 2
	DefaultHealthyThreshold     = 1
	healthCheckConcurrencyLimit = 16
)

// Target is one deployment to probe: its id and API base (".../v1"; the
// engine's /health is at its root, as vLLM serves it).
type Target struct {
	ID, APIBase string
}

// HealthURL returns the /health URL of an API base.
func HealthURL(apiBase string) string {
	b := strings.TrimSuffix(apiBase, "/")
	b = strings.TrimSuffix(b, "/v1")
	return b + "/health"
}

// Checker runs active health checks (a component: Run). A probe fails when
// the engine cannot be reached, does not answer within the timeout, or
// answers 5xx. Every proxy
// probes on its own, so all take a dead engine out within an interval or
// two, without sharing state.
type Checker struct {
	// Targets returns the deployments to probe now (the catalog's).
	Targets func() []Target
	States  *States
	Client  *http.Client
	// Interval, Timeout and the thresholds (zero: the defaults).
	Interval, Timeout                    time.Duration
	UnhealthyThreshold, HealthyThreshold int
	// OnChange is told when a deployment goes down or comes back.
	OnChange func(id string, down bool)

	mu    sync.Mutex
	count map[string]int // consecutive results: > 0 successes, < 0 failures
}

// Run probes every target each interval until ctx ends (nil then).
func (c *Checker) Run(ctx context.Context) error {
	if c.Interval <= 0 {
		c.Interval = DefaultHealthCheckInterval
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultHealthCheckTimeout
	}
	if c.UnhealthyThreshold <= 0 {
		c.UnhealthyThreshold = DefaultUnhealthyThreshold
	}
	if c.HealthyThreshold <= 0 {
		c.HealthyThreshold = DefaultHealthyThreshold
	}
	c.count = map[string]int{}
	t := time.NewTicker(c.Interval)
	defer t.Stop()
	for {
		c.round(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (c *Checker) round(ctx context.Context) {
	targets := c.Targets()
	sem := make(chan struct{}, healthCheckConcurrencyLimit)
	var wg sync.WaitGroup
	for _, tg := range targets {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			ok := c.probe(ctx, tg)
			if ctx.Err() == nil {
				c.record(tg.ID, ok)
			}
		}()
	}
	wg.Wait()
}

func (c *Checker) probe(ctx context.Context, tg Target) bool {
	pctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(pctx, http.MethodGet, HealthURL(tg.APIBase), nil)
	if err != nil {
		return false
	}
	resp, err := c.Client.Do(req)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
	_ = resp.Body.Close()
	// A 5xx is an engine that says it is down (vLLM answers 503 once its
	// engine died); a 4xx is a server without a /health route, which says
	// nothing against it.
	return resp.StatusCode < 500
}

func (c *Checker) record(id string, ok bool) {
	c.mu.Lock()
	n := c.count[id]
	switch {
	case ok && n >= 0:
		n++
	case ok:
		n = 1
	case n <= 0:
		n--
	default:
		n = -1
	}
	c.count[id] = n
	c.mu.Unlock()
	h := &c.States.Get(id).Health
	switch {
	case !ok && -n >= c.UnhealthyThreshold && !h.activeDown.Load():
		h.activeDown.Store(true)
		h.Probation.Revoke() // an engine back from being down has to prove its streams again
		if c.OnChange != nil {
			c.OnChange(id, true)
		}
	case ok && n >= c.HealthyThreshold && h.activeDown.Load():
		h.activeDown.Store(false)
		if c.OnChange != nil {
			c.OnChange(id, false)
		}
	}
}
