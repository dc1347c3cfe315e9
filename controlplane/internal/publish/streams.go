// Streams and buckets: the infrastructure the leader creates, and the
// positions of region streams it adopts or realigns.

package publish

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// ensureInfra creates the buckets and every region's stream.
func (p *Publisher) ensureInfra(ctx context.Context) error {
	if _, err := p.js.CreateOrUpdateObjectStore(ctx, jetstream.ObjectStoreConfig{
		Bucket: wire.SnapshotBucket, Storage: jetstream.FileStorage, Replicas: p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("snapshot bucket: %w", err)
	}
	if _, err := p.js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket: wire.PointerBucket, History: 10, Storage: jetstream.FileStorage, Replicas: p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("pointer bucket: %w", err)
	}
	if _, err := p.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        wire.UsageStream,
		Description: "usage events of every region, consumed into the spend ledger",
		Subjects:    []string{wire.UsageSubjectAll},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      UsageStreamMaxAge,
		Duplicates:  UsageDuplicateWindow,
		Replicas:    p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("usage stream: %w", err)
	}
	if _, err := p.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        wire.AlertStream,
		Description: "budget alerts of every region, recorded into budget_alerts",
		Subjects:    []string{wire.AlertSubjectAll},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      AlertStreamMaxAge,
		Duplicates:  AlertDuplicateWindow,
		Replicas:    p.cfg.Replicas,
	}); err != nil {
		return fmt.Errorf("alert stream: %w", err)
	}
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return err
	}
	for _, r := range regions {
		if err := p.ensureStream(ctx, r.Name); err != nil {
			return err
		}
	}
	return nil
}

func (p *Publisher) ensureStream(ctx context.Context, region string) error {
	_, err := p.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:       wire.EventStream(region),
		Subjects:   []string{wire.EventSubject(region)},
		Storage:    jetstream.FileStorage,
		Retention:  jetstream.LimitsPolicy,
		MaxAge:     p.cfg.StreamMaxAge,
		Duplicates: DefaultDuplicateWindow,
		Replicas:   p.cfg.Replicas,
	})
	if err != nil {
		return fmt.Errorf("event stream of region %s: %w", region, err)
	}
	return nil
}

func (p *Publisher) needsInitialCompile(ctx context.Context) (bool, error) {
	next, err := p.store.NextConfigVersion(ctx)
	if err != nil {
		return false, err
	}
	if next == 1 {
		return true, nil
	}
	// An epoch without its first version: the regions still point at
	// versions of the abandoned history.
	if ep, ok, err := p.store.CurrentEpoch(ctx); err != nil {
		return false, err
	} else if ok && ep.FirstVersion == 0 {
		p.log.Warn("compiling the first snapshot of distribution epoch", "epoch", ep.Epoch, "version_floor", ep.VersionFloor)
		return true, nil
	}
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return false, err
	}
	need := false
	for _, r := range regions {
		if r.CurrentVersion == 0 {
			need = true
		}
		lost, err := p.realignStream(ctx, r)
		if err != nil {
			return false, err
		}
		if lost {
			need = true
		}
	}
	// NATS may have lost the buckets' contents (a new server, a wiped
	// store): every region needs a pointer to a snapshot that exists.
	kv, err := p.js.KeyValue(ctx, wire.PointerBucket)
	if err != nil {
		return false, fmt.Errorf("pointer bucket: %w", err)
	}
	obs, err := p.js.ObjectStore(ctx, wire.SnapshotBucket)
	if err != nil {
		return false, fmt.Errorf("snapshot bucket: %w", err)
	}
	for _, r := range regions {
		e, err := kv.Get(ctx, wire.PointerKey(r.Name))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			need = true
			continue
		}
		if err != nil {
			return false, fmt.Errorf("read pointer of region %s: %w", r.Name, err)
		}
		ptr := &configv1.SnapshotPointer{}
		if proto.Unmarshal(e.Value(), ptr) != nil {
			need = true
			continue
		}
		if _, err := obs.GetInfo(ctx, ptr.GetObject()); errors.Is(err, jetstream.ErrObjectNotFound) {
			need = true
		} else if err != nil {
			return false, fmt.Errorf("check snapshot object %s: %w", ptr.GetObject(), err)
		}
	}
	if need {
		p.log.Warn("compiling a fresh snapshot at start: NATS lacks a region's pointer, snapshot or events")
	}
	return need, nil
}

// realignStream handles a region stream that is behind the database's
// position (NATS lost data, or a new NATS server): it moves the stream's
// next sequence to the database's position + 1 so appends continue, and
// reports true so a fresh snapshot covers whatever was lost.
func (p *Publisher) realignStream(ctx context.Context, r store.RegionState) (bool, error) {
	st, err := p.js.Stream(ctx, wire.EventStream(r.Name))
	if err != nil {
		return false, fmt.Errorf("event stream of region %s: %w", r.Name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return false, fmt.Errorf("event stream of region %s: %w", r.Name, err)
	}
	if info.State.LastSeq >= uint64(r.RegionSeq) {
		return false, nil
	}
	p.log.Warn("region event stream is behind the database; realigning (NATS lost data?)",
		"region", r.Name, "stream_last_seq", info.State.LastSeq, "region_seq", r.RegionSeq)
	if err := st.Purge(ctx, jetstream.WithPurgeSequence(uint64(r.RegionSeq)+1)); err != nil {
		return false, fmt.Errorf("realign event stream of region %s: %w", r.Name, err)
	}
	return true, nil
}

// adoptStream returns the last sequence of a new region's stream: 0 for
// a new stream; more when NATS kept the stream of a region of the same
// name from another history (created in a database since restored from an
// older backup, or replaced). The region's events continue after it and
// its first snapshot records that position, so data planes of the region
// never replay the other history onto it (its snapshot versions are above
// that history's: the epoch that followed the switch saw its pointer).
func (p *Publisher) adoptStream(ctx context.Context, region string) (int64, error) {
	last, err := p.streamLast(ctx, region)
	if err != nil {
		return 0, err
	}
	if last > 0 {
		p.log.Warn("the new region's event stream already holds events of another history; its events continue after them",
			"region", region, "stream_last_seq", last)
	}
	return int64(last), nil
}
