// Snapshots: full configuration compiled into the object store, one
// version at a time, with each region's stream position at compile time.

package publish

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/configmsg"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// compile builds, stores and records a new snapshot version.
func (p *Publisher) compile(ctx context.Context) error {
	start := time.Now()
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return err
	}
	seqs := map[string]int64{}
	for _, r := range regions {
		seqs[r.Name] = r.RegionSeq
		if r.CurrentVersion == 0 && r.RegionSeq == 0 {
			// A region created since the last publishAll: its pointer row
			// has not adopted its stream yet. Its first snapshot records the
			// position publishAll will adopt (adoptStream), never 0 over a
			// stream that holds another history's events.
			if err := p.ensureStream(ctx, r.Name); err != nil {
				return err
			}
			last, err := p.adoptStream(ctx, r.Name)
			if err != nil {
				return err
			}
			seqs[r.Name] = last
		}
	}
	st, err := p.store.ConfigState(ctx)
	if err != nil {
		return err
	}
	v, err := p.store.NextConfigVersion(ctx)
	if err != nil {
		return err
	}
	now := p.cfg.Now().UTC()
	snap, err := snapshotFrom(st, uint64(v), now)
	if err != nil {
		return err
	}
	body, digest, err := wire.EncodeSnapshot(snap)
	if err != nil {
		return err
	}
	obs, err := p.js.ObjectStore(ctx, wire.SnapshotBucket)
	if err != nil {
		return fmt.Errorf("snapshot bucket: %w", err)
	}
	name := wire.SnapshotObject(uint64(v))
	if _, err := obs.PutBytes(ctx, name, body); err != nil {
		return fmt.Errorf("store snapshot %d: %w", v, err)
	}
	if _, err := p.store.RecordConfigVersion(ctx, store.VersionRecord{
		Version: v, EventsSeq: st.EventsSeq, Digest: digest, Size: int64(len(body)), Object: name, CreatedAt: now,
	}, seqs); err != nil {
		return err
	}
	p.compiles.Add(1)
	p.lastVersion.Store(v)
	p.lastCompileNanos.Store(int64(time.Since(start)))
	p.lastSnapshotBytes.Store(int64(len(body)))
	p.log.Info("compiled snapshot", "version", v, "events_seq", st.EventsSeq, "keys", len(snap.Keys), "deployments", len(snap.Deployments),
		"size_bytes", len(body), "duration_ms", time.Since(start).Milliseconds())
	return nil
}

// snapshotFrom builds the snapshot of st as version v.
func snapshotFrom(st store.ConfigState, v uint64, now time.Time) (*configv1.Snapshot, error) {
	s := &configv1.Snapshot{
		SchemaVersion: wire.SchemaVersion, Version: v, CreatedAt: timestamppb.New(now), EventsSeq: uint64(st.EventsSeq),
		Orgs: make([]*configv1.Org, 0, len(st.Orgs)), Teams: make([]*configv1.Team, 0, len(st.Teams)),
		Users: make([]*configv1.User, 0, len(st.Users)), Members: make([]*configv1.Member, 0, len(st.Members)),
		Customers: make([]*configv1.Customer, 0, len(st.Customers)), Keys: make([]*configv1.Key, 0, len(st.Keys)),
		ModelGroups: make([]*configv1.ModelGroup, 0, len(st.ModelGroups)), Deployments: make([]*configv1.Deployment, 0, len(st.Deployments)),
	}
	for _, o := range st.Orgs {
		m, err := configmsg.Org(o)
		if err != nil {
			return nil, err
		}
		s.Orgs = append(s.Orgs, m)
	}
	for _, t := range st.Teams {
		m, err := configmsg.Team(t)
		if err != nil {
			return nil, err
		}
		s.Teams = append(s.Teams, m)
	}
	for _, u := range st.Users {
		m, err := configmsg.User(u)
		if err != nil {
			return nil, err
		}
		s.Users = append(s.Users, m)
	}
	for _, mb := range st.Members {
		m, err := configmsg.Member(mb)
		if err != nil {
			return nil, err
		}
		s.Members = append(s.Members, m)
	}
	for _, c := range st.Customers {
		m, err := configmsg.Customer(c)
		if err != nil {
			return nil, err
		}
		s.Customers = append(s.Customers, m)
	}
	for _, ls := range st.LabelScopes {
		m, err := configmsg.LabelScope(ls)
		if err != nil {
			return nil, err
		}
		s.LabelScopes = append(s.LabelScopes, m)
	}
	for _, ti := range st.Issuers {
		s.TrustedIssuers = append(s.TrustedIssuers, configmsg.TrustedIssuer(ti))
	}
	for _, k := range st.Keys {
		m, err := configmsg.Key(k, now)
		if err != nil {
			return nil, err
		}
		s.Keys = append(s.Keys, m)
	}
	for _, g := range st.ModelGroups {
		m, err := configmsg.ModelGroup(g)
		if err != nil {
			return nil, err
		}
		s.ModelGroups = append(s.ModelGroups, m)
	}
	for _, d := range st.Deployments {
		m, err := configmsg.Deployment(d)
		if err != nil {
			return nil, err
		}
		s.Deployments = append(s.Deployments, m)
	}
	return s, nil
}
