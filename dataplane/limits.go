package dataplane

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	apiproxy "github.com/sluicegw/sluice/dataplane/internal/proxy"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Limits defaults (docs/limits.md).
const (
	DefaultRedisURL       = "redis://127.0.0.1:6379/0"
	DefaultRedisKeyPrefix = "sluice:"
	// RateFallbackClosed refuses rpm/tpm-limited requests while Redis is
	// unavailable (503 limits_unavailable), like budgets and concurrency.
	RateFallbackClosed = "closed"
	// RateFallbackLocal admits rpm/tpm-only requests by this instance's
	// share of each limit (limit ÷ live data planes in the region).
	RateFallbackLocal = "local"
	// DefaultLimitsCallTimeout bounds every limits-store call.
	DefaultLimitsCallTimeout = limits.DefaultCallTimeout
	// DefaultLeaseTTL is the life of a concurrency slot without renewal.
	DefaultLeaseTTL = limits.DefaultLeaseTTL
	// DefaultMaxOutputTokens bounds estimates of requests without max_tokens.
	DefaultMaxOutputTokens = apiproxy.DefaultMaxOutputTokens
)

// newLimitsStore returns the limits store configuration for a Limiter: a
// Redis Cluster client (go-redis, which routes by slot) when clusterAddrs
// is set, else the pipelining client of package redispipe on url (one
// Redis; see that package for why the request path does not use go-redis
// there). Every call carries its own deadline; dialing is bounded too, so
// an unreachable Redis fails a call fast rather than stalling it.
func newLimitsStore(url string, clusterAddrs []string) (limits.Config, io.Closer, error) {
	if len(clusterAddrs) > 0 {
		rdb := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: clusterAddrs, ContextTimeoutEnabled: true, DialTimeout: 250 * time.Millisecond,
			// A call's own deadline bounds it; retries would only spend
			// that budget on a dead connection, and one dial per call
			// fails a refused connection at once. RESP2: the scripts
			// return integer arrays; RESP3 would only add a
			// push-notification check to every call.
			PoolSize: 256, MinIdleConns: 4, MaxRetries: -1, DialerRetries: 1, Protocol: 2,
		})
		return limits.Config{Client: rdb}, rdb, nil
	}
	opt, err := redispipe.ParseURL(url)
	if err != nil {
		return limits.Config{}, nil, err
	}
	opt.DialTimeout = 250 * time.Millisecond
	pipe, err := redispipe.New(opt)
	if err != nil {
		return limits.Config{}, nil, fmt.Errorf("redis url: %w", err)
	}
	return limits.Config{Pipe: pipe}, pipe, nil
}

// alertPublisher publishes budget alerts to JetStream (wire.AlertStream)
// with the alert id as dedupe id. Alerts are rare; a bounded queue and a
// retrying publisher keep them off the request path. An alert that cannot
// be published for alertGiveUp is logged (it stays visible in the metric
// and the log line of the proxy).
type alertPublisher struct {
	js     jetstream.JetStream
	region string
	log    *slog.Logger
	ch     chan *usagev1.BudgetAlert
	wg     sync.WaitGroup
}

const (
	alertQueue  = 1024
	alertGiveUp = time.Minute
)

func newAlertPublisher(nc *nats.Conn, region string, log *slog.Logger) (*alertPublisher, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	return &alertPublisher{js: js, region: region, log: log, ch: make(chan *usagev1.BudgetAlert, alertQueue)}, nil
}

// Alert implements proxy.AlertSink.
func (p *alertPublisher) Alert(a *usagev1.BudgetAlert) {
	select {
	case p.ch <- a:
	default:
		p.log.Error("budget alert dropped: alert queue full", "alert_id", a.GetAlertId())
	}
}

// run publishes until ctx ends, then drains what is queued (bounded).
func (p *alertPublisher) run(ctx context.Context) {
	for {
		select {
		case a := <-p.ch:
			p.publish(ctx, a)
		case <-ctx.Done():
			for {
				select {
				case a := <-p.ch:
					dctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
					p.publish(dctx, a)
					cancel()
				default:
					return
				}
			}
		}
	}
}

func (p *alertPublisher) publish(ctx context.Context, a *usagev1.BudgetAlert) {
	data, err := wire.Marshal(a)
	if err != nil {
		p.log.Error("encode budget alert", "error", err)
		return
	}
	deadline := time.Now().Add(alertGiveUp)
	backoff := 100 * time.Millisecond
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err = p.js.Publish(pctx, wire.AlertSubject(p.region), data, jetstream.WithMsgID(a.GetAlertId()))
		cancel()
		if err == nil {
			return
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			p.log.Error("budget alert not published", "alert_id", a.GetAlertId(), "error", err)
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 5*time.Second)
	}
}

// fleetView counts the live data planes of the region from their
// heartbeats (this instance included), for the local rpm/tpm fallback.
type fleetView struct {
	self    string
	horizon time.Duration
	mu      sync.Mutex
	seen    map[string]time.Time
}

func newFleetView(nc *nats.Conn, region, self string, heartbeat time.Duration) (*fleetView, *nats.Subscription, error) {
	f := &fleetView{self: self, horizon: 3 * heartbeat, seen: map[string]time.Time{}}
	sub, err := nc.Subscribe(wire.HeartbeatSubjectPrefix+region+".*", func(m *nats.Msg) {
		var hb configv1.Heartbeat
		if wire.Unmarshal(m.Data, &hb) != nil || hb.GetInstanceId() == "" {
			return
		}
		f.mu.Lock()
		f.seen[hb.GetInstanceId()] = time.Now()
		f.mu.Unlock()
	})
	return f, sub, err
}

// Live returns the number of data planes heard from within three heartbeat
// intervals, at least 1 (this one).
func (f *fleetView) Live() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 1
	for id, t := range f.seen {
		switch {
		case time.Since(t) > f.horizon:
			delete(f.seen, id)
		case id != f.self:
			n++
		}
	}
	return n
}

// limitsSetup builds the limiter (and its fallback) from cfg.
func limitsSetup(cfg *Config) (*limits.Limiter, io.Closer, error) {
	lc, rdb, err := newLimitsStore(cfg.RedisURL, cfg.RedisClusterAddrs)
	if err != nil {
		return nil, nil, err
	}
	lc.KeyPrefix, lc.CallTimeout, lc.LeaseTTL = cfg.RedisKeyPrefix, cfg.LimitsCallTimeout, cfg.LeaseTTL
	lim, err := limits.New(lc)
	if err != nil {
		_ = rdb.Close()
		return nil, nil, err
	}
	return lim, rdb, nil
}

func validateLimits(c *Config) []error {
	var errs []error
	if c.RedisURL == "" && len(c.RedisClusterAddrs) == 0 {
		errs = append(errs, errors.New("a Redis URL (--redis-url) or cluster addresses (--redis-cluster) are required: limits fail closed without Redis"))
	}
	if c.RedisURL != "" && len(c.RedisClusterAddrs) == 0 {
		if _, err := redispipe.ParseURL(c.RedisURL); err != nil {
			errs = append(errs, err)
		}
	}
	if strings.ContainsAny(c.RedisKeyPrefix, "{}") {
		errs = append(errs, fmt.Errorf("redis key prefix %q must not contain '{' or '}'", c.RedisKeyPrefix))
	}
	if c.LimitsCallTimeout < 0 || c.LeaseTTL < 0 {
		errs = append(errs, errors.New("limits call timeout and lease TTL must not be negative"))
	}
	if c.LeaseTTL > 0 && c.LeaseTTL <= limits.DefaultRenewInterval {
		errs = append(errs, fmt.Errorf("lease TTL %s must exceed the renew interval %s", c.LeaseTTL, limits.DefaultRenewInterval))
	}
	if c.RateLimitFallback != RateFallbackClosed && c.RateLimitFallback != RateFallbackLocal {
		errs = append(errs, fmt.Errorf("rate limit fallback %q: want %s or %s", c.RateLimitFallback, RateFallbackClosed, RateFallbackLocal))
	}
	if c.DefaultMaxOutputTokens < 0 {
		errs = append(errs, errors.New("default max output tokens must not be negative"))
	}
	return errs
}

// bootstrapEpochs marks the limits state of orgs and deployments created by
// an event as known-new (limits.Limiter.Bootstrap), so their first requests
// are not quarantined as if Redis had lost their state.
func bootstrapEpochs(lim *limits.Limiter, log *slog.Logger) func(orgs, deployments []string) {
	return func(orgs, deployments []string) {
		ids := orgs
		for _, d := range deployments {
			ids = append(ids, limits.DeploymentOrg(d))
		}
		for _, id := range ids {
			if err := lim.Bootstrap(context.Background(), id); err != nil {
				log.Warn("limits epoch not bootstrapped; the first requests of this owner may wait out the quarantine", "owner", id, "error", err)
			}
		}
	}
}
