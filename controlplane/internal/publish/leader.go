// Leadership: one replica at a time publishes, holding a Postgres
// advisory lock on a dedicated connection; its loop drains the outbox,
// compiles snapshots and writes pointers.

package publish

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// IsLeader reports whether this replica currently publishes.
func (p *Publisher) IsLeader() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.leader
}

func (p *Publisher) setLeader(v bool) {
	p.mu.Lock()
	p.leader = v
	p.mu.Unlock()
}

// leadLoop tries to lead until ctx is done.
func (p *Publisher) leadLoop(ctx context.Context) {
	// A NATS outage ends leadership (publishing fails); try again as soon
	// as NATS is back rather than up to a retry interval later, so that
	// changes the outbox held during the outage go out at once.
	reconnected := p.nc.StatusChanged(nats.CONNECTED)
	defer p.nc.RemoveStatusListener(reconnected)
	for ctx.Err() == nil {
		if err := p.lead(ctx); err != nil && ctx.Err() == nil {
			p.log.Warn("publisher leadership ended", "error", err)
		}
		// Connected (another replica leads, or the failure was not NATS):
		// try again soon; disconnected: wait for the reconnect.
		wait := time.Second
		if p.nc.IsConnected() {
			wait = 100 * time.Millisecond
		}
		select {
		case <-ctx.Done():
		case <-reconnected:
		case <-time.After(wait):
		}
	}
}

// lead tries to become leader and, if it does, publishes until its lock
// connection fails or ctx is done.
func (p *Publisher) lead(parent context.Context) error {
	if !p.nc.IsConnected() {
		// JetStream calls would only wait out their timeouts; Run retries
		// as soon as the connection is back.
		return errors.New("nats is not connected")
	}
	// Leadership ends the moment NATS disconnects: a JetStream call in
	// flight (a compile, a pointer write) would otherwise wait out its
	// timeout and hold back what the outbox collected meanwhile.
	ctx, endLeadership := context.WithCancel(parent)
	defer endLeadership()
	disconnected := p.nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	defer p.nc.RemoveStatusListener(disconnected)
	go func() {
		select {
		case <-disconnected:
			endLeadership()
		case <-ctx.Done():
		}
	}()
	conn, err := pgx.ConnectConfig(ctx, p.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect for leader lock: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var got bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, int64(leaderLockID)).Scan(&got); err != nil {
		return fmt.Errorf("leader lock: %w", err)
	}
	if !got {
		return nil // another replica leads; try again later
	}
	if _, err := conn.Exec(ctx, `LISTEN sluice_outbox`); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	p.setLeader(true)
	defer p.setLeader(false)
	p.log.Info("publisher is leader", "instance", p.cfg.InstanceID)

	lctx, cancel := context.WithCancel(ctx)
	wake := make(chan struct{}, 1)
	lost := make(chan error, 1)
	listenDone := make(chan struct{})
	// Stop the listener before the deferred conn.Close runs.
	defer func() { cancel(); <-listenDone }()
	go func() {
		defer close(listenDone)
		for {
			if _, err := conn.WaitForNotification(lctx); err != nil {
				lost <- err
				return
			}
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}()
	resync := make(chan struct{}, 1)
	rsub, err := p.nc.Subscribe(wire.ResyncSubject, func(m *nats.Msg) {
		p.log.Info("data plane asked for a fresh snapshot", "region", string(m.Data))
		select {
		case resync <- struct{}{}:
		default:
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe to resync requests: %w", err)
	}
	defer func() { _ = rsub.Unsubscribe() }()
	if err := p.ensureInfra(ctx); err != nil {
		return err
	}
	// What the data planes run, from their heartbeats: a fleet that ran
	// past both the database and JetStream (both restored) is ahead too.
	hsub, err := p.nc.Subscribe(wire.HeartbeatSubjectAll, p.seeHeartbeat)
	if err != nil {
		return fmt.Errorf("subscribe to heartbeats: %w", err)
	}
	defer func() { _ = hsub.Unsubscribe() }()
	// Before anything is published: is JetStream ahead of the database?
	if _, err := p.checkEpoch(ctx, false); err != nil {
		return err
	}
	p.mu.Lock()
	p.pointers = map[string]*configv1.SnapshotPointer{}
	p.mu.Unlock()

	var dirtySince, lastChange time.Time
	need, err := p.needsInitialCompile(ctx)
	if err != nil {
		return err
	}
	if need {
		dirtySince, lastChange = time.Now(), time.Now().Add(-p.cfg.Debounce)
	}
	lastCompile := time.Now()
	// With a compile pending, pointers are written after it: the recorded
	// versions may point at snapshots NATS no longer has.
	refreshPointers := !need
	for {
		changed, pointerRegions, err := p.publishAll(ctx)
		if err != nil {
			return err
		}
		if changed {
			if dirtySince.IsZero() {
				dirtySince = time.Now()
			}
			lastChange = time.Now()
		}
		periodic := time.Since(lastCompile) >= p.cfg.SnapshotInterval
		if need || periodic || !dirtySince.IsZero() && (time.Since(lastChange) >= p.cfg.Debounce || time.Since(dirtySince) >= p.cfg.MaxDelay) {
			need = false
			if err := p.compile(ctx); err != nil {
				p.compileErrors.Add(1)
				return err
			}
			lastCompile = time.Now()
			dirtySince = time.Time{}
			refreshPointers = true
		}
		if refreshPointers || len(pointerRegions) > 0 {
			needCompile, err := p.writePointers(ctx, refreshPointers, pointerRegions)
			if err != nil {
				return err
			}
			refreshPointers = false
			if needCompile && dirtySince.IsZero() {
				dirtySince, lastChange = time.Now(), time.Now().Add(-p.cfg.Debounce)
				continue
			}
		}
		wait := p.cfg.PollInterval
		if !dirtySince.IsZero() {
			wait = min(wait, max(time.Millisecond, p.cfg.Debounce-time.Since(lastChange)))
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-lost:
			return fmt.Errorf("leader connection: %w", err)
		case <-wake:
		case <-resync:
			if dirtySince.IsZero() {
				dirtySince = time.Now()
			}
			lastChange = time.Now().Add(-p.cfg.Debounce)
		case <-p.fleetRaised:
			ahead, err := p.fleetAhead(ctx)
			if err != nil {
				return err
			}
			if !ahead {
				break
			}
			started, err := p.checkEpoch(ctx, true)
			if err != nil {
				return err
			}
			if started {
				p.mu.Lock()
				p.pointers = map[string]*configv1.SnapshotPointer{}
				p.mu.Unlock()
				dirtySince, lastChange = time.Now(), time.Now().Add(-p.cfg.Debounce)
			}
		case <-time.After(wait):
		}
	}
}
