package store

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Rollout policies of a region (regions.policy).
const (
	// RolloutAuto regions run every new config version at once.
	RolloutAuto = "auto"
	// RolloutStaged regions wait for an operator to promote a version.
	RolloutStaged = "staged"
)

// Region is a deployment region: it has its own event stream and a KV
// pointer to the config version its data planes run.
type Region struct {
	Name   string
	Policy string // RolloutAuto or RolloutStaged
	// RegionSeq is the last sequence published to the region's event
	// stream.
	RegionSeq uint64
	// CurrentVersion is the config version the region is told to run; 0
	// until one is assigned.
	CurrentVersion uint64
	// Rollback is set when an operator rolled the region back to an older
	// version (the pointer then allows a lower version than a data plane
	// runs).
	Rollback  bool
	CreatedAt time.Time
	UpdatedAt time.Time
}

// ConfigVersion is one compiled snapshot; its body lives in the JetStream
// object store under Object.
type ConfigVersion struct {
	Version uint64
	// EventsSeq is the last outbox seq the snapshot includes.
	EventsSeq uint64
	Digest    []byte // SHA-256 of the encoded snapshot
	SizeBytes int64
	Object    string
	CreatedAt time.Time
}

func regionFromRow(r dbsqlc.Region) Region {
	return Region{Name: r.Name, Policy: r.Policy, RegionSeq: uint64(r.RegionSeq),
		CurrentVersion: uint64(r.CurrentVersion), Rollback: r.Rollback,
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}
}

func configVersionFromRow(r dbsqlc.ConfigVersion) ConfigVersion {
	return ConfigVersion{Version: uint64(r.Version), EventsSeq: uint64(r.EventsSeq), Digest: r.Digest,
		SizeBytes: r.SizeBytes, Object: r.Object, CreatedAt: r.CreatedAt}
}

// versionArg converts a config version to its column type. Versions above
// math.MaxInt64 cannot be stored, so they name no version.
func versionArg(v uint64) (int64, bool) {
	if v > math.MaxInt64 {
		return 0, false
	}
	return int64(v), true
}

func versionNotFound(v uint64) error {
	return notFound("config version " + strconv.FormatUint(v, 10))
}

// RegionGet returns region name.
func (s *Store) RegionGet(ctx context.Context, name string) (Region, error) {
	r, err := s.q.RegionGet(ctx, s.pool, name)
	if err != nil {
		return Region{}, orNotFound(err, "region "+name)
	}
	return regionFromRow(r), nil
}

// RegionList returns every region in name order. Regions are few (one
// per deployment site), so the list is not paginated.
func (s *Store) RegionList(ctx context.Context) ([]Region, error) {
	rows, err := s.q.RegionList(ctx, s.pool)
	if err != nil {
		return nil, fmt.Errorf("list regions: %w", err)
	}
	out := make([]Region, 0, len(rows))
	for _, r := range rows {
		out = append(out, regionFromRow(r))
	}
	return out, nil
}

// ConfigVersionGet returns config version v.
func (s *Store) ConfigVersionGet(ctx context.Context, v uint64) (ConfigVersion, error) {
	return configVersionGet(ctx, s.q, s.pool, v)
}

// ConfigVersionLatest returns the newest config version; ok is false when
// none has been compiled yet.
func (s *Store) ConfigVersionLatest(ctx context.Context) (cv ConfigVersion, ok bool, err error) {
	r, err := s.q.ConfigVersionLatest(ctx, s.pool)
	if isNoRows(err) {
		return ConfigVersion{}, false, nil
	}
	if err != nil {
		return ConfigVersion{}, false, fmt.Errorf("get latest config version: %w", err)
	}
	return configVersionFromRow(r), true, nil
}

// ConfigVersionRegionSeq returns region's event stream position recorded
// when version v was compiled: a data plane that loads v replays the
// region's events after it. It is ErrFailedPrecondition when v was
// compiled before the region existed (nothing recorded).
func (s *Store) ConfigVersionRegionSeq(ctx context.Context, v uint64, region string) (uint64, error) {
	return configVersionRegionSeq(ctx, s.q, s.pool, v, region)
}

// RegionGetForUpdate returns region name locked for the rest of the
// transaction.
func (t *Tx) RegionGetForUpdate(ctx context.Context, name string) (Region, error) {
	r, err := t.q.RegionGetForUpdate(ctx, t.tx, name)
	if err != nil {
		return Region{}, orNotFound(err, "region "+name)
	}
	return regionFromRow(r), nil
}

// RegionInsert creates r with its policy; the stream position and version
// start at 0, CreatedAt/UpdatedAt are the transaction time.
func (t *Tx) RegionInsert(ctx context.Context, r *Region) error {
	r.RegionSeq, r.CurrentVersion, r.Rollback = 0, 0, false
	r.CreatedAt, r.UpdatedAt = t.now, t.now
	return translate(t.q.RegionInsert(ctx, t.tx, dbsqlc.RegionInsertParams{
		Name: r.Name, Policy: r.Policy, CreatedAt: t.now,
	}))
}

// RegionSetPolicy writes r's rollout policy.
func (t *Tx) RegionSetPolicy(ctx context.Context, r *Region, policy string) error {
	r.Policy, r.UpdatedAt = policy, t.now
	return translate(t.q.RegionSetPolicy(ctx, t.tx, dbsqlc.RegionSetPolicyParams{
		Name: r.Name, Policy: policy, UpdatedAt: t.now,
	}))
}

// RegionSetVersion points r at config version v; rollback marks an
// operator's rollback to an older version. The caller checks that v
// exists (ConfigVersionGet).
func (t *Tx) RegionSetVersion(ctx context.Context, r *Region, v uint64, rollback bool) error {
	arg, ok := versionArg(v)
	if !ok {
		return versionNotFound(v)
	}
	r.CurrentVersion, r.Rollback, r.UpdatedAt = v, rollback, t.now
	return translate(t.q.RegionSetVersion(ctx, t.tx, dbsqlc.RegionSetVersionParams{
		Name: r.Name, CurrentVersion: arg, Rollback: rollback, UpdatedAt: t.now,
	}))
}

// ConfigVersionGet returns config version v inside the transaction.
func (t *Tx) ConfigVersionGet(ctx context.Context, v uint64) (ConfigVersion, error) {
	return configVersionGet(ctx, t.q, t.tx, v)
}

// ConfigVersionRegionSeq is Store.ConfigVersionRegionSeq inside the
// transaction.
func (t *Tx) ConfigVersionRegionSeq(ctx context.Context, v uint64, region string) (uint64, error) {
	return configVersionRegionSeq(ctx, t.q, t.tx, v, region)
}

func configVersionGet(ctx context.Context, q *dbsqlc.Queries, db dbsqlc.DBTX, v uint64) (ConfigVersion, error) {
	arg, ok := versionArg(v)
	if !ok {
		return ConfigVersion{}, versionNotFound(v)
	}
	r, err := q.ConfigVersionGet(ctx, db, arg)
	if isNoRows(err) {
		return ConfigVersion{}, versionNotFound(v)
	}
	if err != nil {
		return ConfigVersion{}, fmt.Errorf("get config version %d: %w", v, err)
	}
	return configVersionFromRow(r), nil
}

func configVersionRegionSeq(ctx context.Context, q *dbsqlc.Queries, db dbsqlc.DBTX, v uint64, region string) (uint64, error) {
	arg, ok := versionArg(v)
	if !ok {
		return 0, versionNotFound(v)
	}
	r, err := q.ConfigVersionRegionGet(ctx, db, dbsqlc.ConfigVersionRegionGetParams{Version: arg, Region: region})
	if isNoRows(err) {
		return 0, &Error{Code: ErrFailedPrecondition, Msg: fmt.Sprintf(
			"config version %d was compiled before region %s existed, so it has no event stream position for it; use a version compiled after the region was created", v, region)}
	}
	if err != nil {
		return 0, fmt.Errorf("get stream position of region %s in config version %d: %w", region, v, err)
	}
	return uint64(r.RegionSeq), nil
}
