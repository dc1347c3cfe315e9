package store

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Fallback model groups and per-group resilience settings (SPEC §7.3)
// live on their owners' rows: a model group's ordered fallbacks and the
// JSON of its sluice.admin.v1.ModelGroupResilience, keys' and teams'
// per-group overrides as JSON. The owners' reads return them; these
// setters replace them. Writers call FallbacksLock first (it serialises
// fallback changes, so a cycle check sees every committed edge), then read
// the owner FOR UPDATE.

// Fallbacks maps a model group to its ordered fallbacks (a key's or a
// team's overrides; an empty list turns a group's fallbacks off).
type Fallbacks map[string][]string

func decodeFallbacks(b []byte) (Fallbacks, error) {
	if len(b) == 0 {
		return Fallbacks{}, nil
	}
	out := Fallbacks{}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
	}
	return out, nil
}

func encodeFallbacks(f Fallbacks) []byte {
	if f == nil {
		f = Fallbacks{}
	}
	b, err := json.Marshal(f)
	if err != nil {
		panic(err) // a map of string slices always marshals
	}
	return b
}

// FallbacksLock serialises fallback changes until the transaction ends.
func (t *Tx) FallbacksLock(ctx context.Context) error {
	return translate(t.q.ModelGroupFallbacksLock(ctx, t.tx))
}

// ModelGroupFallbackGraph returns every model group's fallbacks.
func (t *Tx) ModelGroupFallbackGraph(ctx context.Context) (map[string][]string, error) {
	rows, err := t.q.ModelGroupFallbackGraph(ctx, t.tx)
	if err != nil {
		return nil, fmt.Errorf("read model group fallbacks: %w", err)
	}
	out := make(map[string][]string, len(rows))
	for _, r := range rows {
		out[r.Name] = r.Fallbacks
	}
	return out, nil
}

// ModelGroupFallbackReferrers returns the model groups listing name among
// their fallbacks.
func (t *Tx) ModelGroupFallbackReferrers(ctx context.Context, name string) ([]string, error) {
	out, err := t.q.ModelGroupFallbackReferrers(ctx, t.tx, name)
	if err != nil {
		return nil, fmt.Errorf("read referrers of model group %s: %w", name, err)
	}
	return out, nil
}

// ModelGroupResilienceSet replaces g's fallbacks and resilience settings
// (JSON) and bumps its update time.
func (t *Tx) ModelGroupResilienceSet(ctx context.Context, g *ModelGroup, fallbacks []string, resilience []byte) error {
	g.Fallbacks, g.Resilience, g.UpdatedAt = nonNil(fallbacks), resilience, t.now
	return translate(t.q.ModelGroupResilienceSet(ctx, t.tx, dbsqlc.ModelGroupResilienceSetParams{
		Name: g.Name, Fallbacks: g.Fallbacks, Resilience: resilience, UpdatedAt: t.now}))
}

// KeyFallbacksSet replaces k's fallback overrides and bumps its update
// time.
func (t *Tx) KeyFallbacksSet(ctx context.Context, k *Key, f Fallbacks) error {
	k.Fallbacks, k.UpdatedAt = f, t.now
	return translate(t.q.KeyFallbacksSet(ctx, t.tx, dbsqlc.KeyFallbacksSetParams{
		OrgID: k.OrgID, ID: k.ID, Fallbacks: encodeFallbacks(f), UpdatedAt: t.now}))
}

// TeamFallbacksSet replaces tm's fallback overrides and bumps its update
// time.
func (t *Tx) TeamFallbacksSet(ctx context.Context, tm *Team, f Fallbacks) error {
	tm.Fallbacks, tm.UpdatedAt = f, t.now
	return translate(t.q.TeamFallbacksSet(ctx, t.tx, dbsqlc.TeamFallbacksSetParams{
		OrgID: tm.OrgID, ID: tm.ID, Fallbacks: encodeFallbacks(f), UpdatedAt: t.now}))
}
