package dataplane

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// newLimitsStore returns the limits store configuration for a Limiter
// over the data plane's Redis connection (redisconn.Open, shared with the
// other Redis users of the data plane).
func newLimitsStore(url string, clusterAddrs []string) (limits.Config, *redisconn.Conn, error) {
	conn, err := redisconn.Open(url, clusterAddrs)
	if err != nil {
		return limits.Config{}, nil, err
	}
	lc := limits.Config{Pipe: conn.Pipe}
	if conn.Cluster != nil {
		lc.Client = conn.Cluster
	}
	return lc, conn, nil
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
// Run publishes alerts until ctx ends, then those still queued (each
// within a short deadline).
func (p *alertPublisher) Run(ctx context.Context) error {
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
					return nil
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
func limitsSetup(cfg *Config, seeds limits.SeedFunc) (*limits.Limiter, *redisconn.Conn, error) {
	lc, rdb, err := newLimitsStore(cfg.RedisURL, cfg.RedisClusterAddrs)
	if err != nil {
		return nil, nil, err
	}
	lc.KeyPrefix, lc.CallTimeout, lc.LeaseTTL = cfg.RedisKeyPrefix, cfg.LimitsCallTimeout, cfg.LeaseTTL
	lc.Seeds, lc.SeedWait = seeds, cfg.BudgetSeedWait
	lc.Slices.Enabled = !cfg.NoLimitSlices
	lim, err := limits.New(lc)
	if err != nil {
		_ = rdb.Close()
		return nil, nil, err
	}
	return lim, rdb, nil
}

// affinityCallTimeout bounds the affinity lookups and pin writes: their
// default (100 ms), or the limits deadline when an operator set a longer
// one. The lookup runs beside the admission call, which already waits up
// to that deadline on the same Redis, so a Redis that needs it for limits
// gets it for routing too instead of every lookup timing out and every
// proxy routing on its own counts (docs/routing.md, "Round trips").
func affinityCallTimeout(limitsCall time.Duration) time.Duration {
	return max(affinity.DefaultCallTimeout, limitsCall)
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
