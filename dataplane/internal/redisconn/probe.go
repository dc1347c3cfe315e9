package redisconn

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// Probe defaults: a PING every ProbeInterval, each bounded by ProbeTimeout,
// so an unreachable Redis is reported within ProbeInterval+ProbeTimeout
// (well under a second) and a Redis that is back within ProbeInterval.
const (
	ProbeInterval = 200 * time.Millisecond
	ProbeTimeout  = 300 * time.Millisecond
)

// Ping sends PING with ctx's deadline.
func (c *Conn) Ping(ctx context.Context) error {
	if c.Cluster != nil {
		return c.Cluster.Ping(ctx).Err()
	}
	_, err := c.Pipe.Do(ctx, "PING")
	return err
}

// Probe watches whether Redis answers: the readiness of a proxy whose
// limits fail closed (a load balancer should stop sending requests that
// can only be refused with 503 limits_unavailable). It is a component:
// Run pings until ctx ends. Until its first PING completes it reports
// reachable (the limits stage reports a Redis that is down on its own).
type Probe struct {
	conn              *Conn
	interval, timeout time.Duration
	// down is the last failure (nil: reachable).
	down atomic.Pointer[ProbeFailure]
}

// ProbeFailure describes an unreachable Redis.
type ProbeFailure struct {
	Since time.Time
	Err   string
}

// NewProbe returns a probe of c (zero interval/timeout: the defaults).
func NewProbe(c *Conn, interval, timeout time.Duration) *Probe {
	if interval <= 0 {
		interval = ProbeInterval
	}
	if timeout <= 0 {
		timeout = ProbeTimeout
	}
	return &Probe{conn: c, interval: interval, timeout: timeout}
}

// Down returns the current failure, or nil while Redis answers.
func (p *Probe) Down() *ProbeFailure { return p.down.Load() }

// Run pings Redis until ctx ends; it returns nil then.
func (p *Probe) Run(ctx context.Context) error {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for {
		p.check(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (p *Probe) check(ctx context.Context) {
	c, cancel := context.WithTimeout(ctx, p.timeout)
	err := p.conn.Ping(c)
	cancel()
	if ctx.Err() != nil {
		return
	}
	if err == nil {
		p.down.Store(nil)
		return
	}
	if cur := p.down.Load(); cur != nil {
		// Keep the first failure's time; refresh its reason.
		p.down.Store(&ProbeFailure{Since: cur.Since, Err: err.Error()})
		return
	}
	p.down.Store(&ProbeFailure{Since: time.Now(), Err: err.Error()})
}

// String describes the failure for /readyz.
func (f *ProbeFailure) String() string {
	return fmt.Sprintf("limits store (Redis) unreachable for %s: %s", time.Since(f.Since).Round(time.Millisecond), f.Err)
}
