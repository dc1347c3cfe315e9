package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// ModelGroup is a name clients ask for; its deployments serve it. Model
// groups and deployments are platform objects: they belong to no org.
type ModelGroup struct {
	Name        string
	Description string
	// PlatformWide groups are visible to every org; the others only to
	// the orgs in OrgIDs (their grants).
	PlatformWide bool
	// OrgIDs are the orgs the group is granted to, sorted. Filled by
	// ModelGroupGet and the config read (snapshots and events); nil in
	// lists.
	OrgIDs []string
	// Traffic is JSON of sluice.admin.v1.ModelGroupTraffic ("{}": nothing
	// set); it changes only through ModelGroupTrafficSet.
	Traffic []byte
	// Routing is JSON of sluice.admin.v1.ModelGroupRouting ("{}" or nil:
	// the defaults); ModelGroupInsert and ModelGroupUpdate write it.
	Routing []byte
	// Fallbacks are the ordered fallback groups; Resilience is JSON of
	// sluice.admin.v1.ModelGroupResilience ("{}": the proxy's flags). Both
	// change only through ModelGroupResilienceSet.
	Fallbacks  []string
	Resilience []byte
	CreatedAt  time.Time
	UpdatedAt  time.Time
}

// Capabilities is what requests a deployment can serve (stored as JSON in
// deployments.capabilities).
type Capabilities struct {
	Tools           bool  `json:"tools,omitempty"`
	JSONMode        bool  `json:"json_mode,omitempty"`
	Vision          bool  `json:"vision,omitempty"`
	MaxInputTokens  int64 `json:"max_input_tokens,omitempty"`
	MaxOutputTokens int64 `json:"max_output_tokens,omitempty"`
	// Protocols are the wire protocols served besides the OpenAI ones
	// ("anthropic_messages", "openai_responses").
	Protocols []string `json:"protocols,omitempty"`
}

// Deployment is one upstream engine of a model group. Its credential is
// only ever held sealed by the key ring (CredentialCiphertext); the store
// never sees the plaintext.
type Deployment struct {
	ID            string
	ModelGroup    string
	APIBase       string
	UpstreamModel string
	// CredentialCiphertext is keyring.Seal output ("v<N>:..."), nil for
	// none.
	CredentialCiphertext []byte
	Weight               int32
	MaxConcurrency       int64
	Capabilities         Capabilities
	Tags                 []string
	// Prices in USD per token.
	InputPrice       float64
	OutputPrice      float64
	CachedInputPrice float64
	Free             bool
	// Traffic is JSON of sluice.admin.v1.DeploymentTraffic ("{}": nothing
	// set); it changes only through DeploymentTrafficSet.
	Traffic   []byte
	CreatedAt time.Time
	UpdatedAt time.Time
}

func modelGroupFromRow(r dbsqlc.ModelGroup) ModelGroup {
	return ModelGroup{Name: r.Name, Description: r.Description, PlatformWide: r.PlatformWide, Traffic: r.Traffic, Routing: r.Routing,
		Fallbacks: nonNil(r.Fallbacks), Resilience: r.Resilience, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}
}

func deploymentFromRow(r dbsqlc.Deployment) (Deployment, error) {
	d := Deployment{
		ID: r.ID, ModelGroup: r.ModelGroup, APIBase: r.ApiBase, UpstreamModel: r.UpstreamModel,
		CredentialCiphertext: r.CredentialCiphertext, Weight: r.Weight, MaxConcurrency: r.MaxConcurrency,
		Tags: r.Tags, InputPrice: r.InputPrice, OutputPrice: r.OutputPrice, CachedInputPrice: r.CachedInputPrice,
		Free: r.Free, Traffic: r.Traffic, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
	}
	if len(r.CredentialCiphertext) == 0 {
		d.CredentialCiphertext = nil
	}
	if len(r.Capabilities) > 0 {
		if err := json.Unmarshal(r.Capabilities, &d.Capabilities); err != nil {
			return Deployment{}, fmt.Errorf("decode capabilities of deployment %s: %w", r.ID, err)
		}
	}
	if d.Tags == nil {
		d.Tags = []string{}
	}
	return d, nil
}

func deploymentsFromRows(rows []dbsqlc.Deployment) ([]Deployment, error) {
	out := make([]Deployment, 0, len(rows))
	for _, r := range rows {
		d, err := deploymentFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}

func capabilitiesJSON(c Capabilities) []byte {
	b, err := json.Marshal(c)
	if err != nil {
		panic(err) // a struct of bools and ints always marshals
	}
	return b
}

func tagsOrEmpty(t []string) []string {
	if t == nil {
		return []string{}
	}
	return t
}

// ModelGroupGet returns model group name.
func (s *Store) ModelGroupGet(ctx context.Context, name string) (ModelGroup, error) {
	r, err := s.q.ModelGroupGet(ctx, s.pool, name)
	if err != nil {
		return ModelGroup{}, orNotFound(err, "model group "+name)
	}
	g := modelGroupFromRow(r)
	if g.OrgIDs, err = s.q.ModelGroupGrantOrgs(ctx, s.pool, name); err != nil {
		return ModelGroup{}, fmt.Errorf("read grants of model group %s: %w", name, err)
	}
	return g, nil
}

// ModelGroupVisibleList returns a page of the model groups org orgID may
// see (platform-wide or granted to it), in name order.
func (s *Store) ModelGroupVisibleList(ctx context.Context, orgID string, p Page) ([]ModelGroup, error) {
	rows, err := s.q.ModelGroupVisibleList(ctx, s.pool, dbsqlc.ModelGroupVisibleListParams{AfterName: p.After, OrgID: orgID, Lim: int32(p.Limit)})
	if err != nil {
		return nil, fmt.Errorf("list model groups of org %s: %w", orgID, err)
	}
	out := make([]ModelGroup, len(rows))
	for i, r := range rows {
		out[i] = modelGroupFromRow(r)
	}
	return out, nil
}

// ModelGroupVisibleTo reports whether org orgID may see model group name
// (ErrNotFound when there is no such group).
func (s *Store) ModelGroupVisibleTo(ctx context.Context, name, orgID string) (bool, error) {
	ok, err := s.q.ModelGroupVisibleTo(ctx, s.pool, dbsqlc.ModelGroupVisibleToParams{Name: name, OrgID: orgID})
	if err != nil {
		return false, orNotFound(err, "model group "+name)
	}
	return ok, nil
}

// ModelGroupGrant lets one org see and call one model group.
type ModelGroupGrant struct {
	ModelGroup string
	OrgID      string
	CreatedAt  time.Time
	CreatedBy  string
}

// GrantQuery filters ModelGroupGrantList ("" is any).
type GrantQuery struct {
	ModelGroup, OrgID string
}

// ModelGroupGrantList returns grants in (model_group, org_id) order after
// the cursor (afterGroup, afterOrg).
func (s *Store) ModelGroupGrantList(ctx context.Context, q GrantQuery, afterGroup, afterOrg string, limit int) ([]ModelGroupGrant, error) {
	rows, err := s.q.ModelGroupGrantList(ctx, s.pool, dbsqlc.ModelGroupGrantListParams{
		ModelGroup: optStr(q.ModelGroup), OrgID: optStr(q.OrgID), AfterGroup: afterGroup, AfterOrg: afterOrg, Lim: int32(limit)})
	if err != nil {
		return nil, fmt.Errorf("list model group grants: %w", err)
	}
	out := make([]ModelGroupGrant, len(rows))
	for i, r := range rows {
		out[i] = ModelGroupGrant{ModelGroup: r.ModelGroup, OrgID: r.OrgID, CreatedAt: r.CreatedAt, CreatedBy: r.CreatedBy}
	}
	return out, nil
}

// ModelGroupGrantInsert stores g (CreatedAt is the transaction time). An
// existing grant is ErrAlreadyExists; an unknown group or org fails its
// foreign key.
func (t *Tx) ModelGroupGrantInsert(ctx context.Context, g *ModelGroupGrant) error {
	g.CreatedAt = t.now
	err := translate(t.q.ModelGroupGrantInsert(ctx, t.tx, dbsqlc.ModelGroupGrantInsertParams{
		ModelGroup: g.ModelGroup, OrgID: g.OrgID, CreatedAt: t.now, CreatedBy: g.CreatedBy}))
	if errors.Is(err, ErrAlreadyExists) {
		return &Error{Code: ErrAlreadyExists, Msg: fmt.Sprintf("model group %s is already granted to org %s", g.ModelGroup, g.OrgID)}
	}
	return err
}

// ModelGroupGrantDelete removes a grant (ErrNotFound when there is none).
func (t *Tx) ModelGroupGrantDelete(ctx context.Context, group, orgID string) error {
	n, err := t.q.ModelGroupGrantDelete(ctx, t.tx, dbsqlc.ModelGroupGrantDeleteParams{ModelGroup: group, OrgID: orgID})
	if err != nil {
		return translate(err)
	}
	if n == 0 {
		return notFound(fmt.Sprintf("grant of model group %s to org %s", group, orgID))
	}
	return nil
}

// ModelGroupList returns a page of model groups in name order.
func (s *Store) ModelGroupList(ctx context.Context, p Page) ([]ModelGroup, error) {
	rows, err := s.q.ModelGroupList(ctx, s.pool, dbsqlc.ModelGroupListParams{AfterName: p.After, Lim: int32(p.Limit)})
	if err != nil {
		return nil, fmt.Errorf("list model groups: %w", err)
	}
	out := make([]ModelGroup, len(rows))
	for i, r := range rows {
		out[i] = modelGroupFromRow(r)
	}
	return out, nil
}

// ModelGroupInsert creates g; CreatedAt/UpdatedAt are set to the
// transaction time.
func (t *Tx) ModelGroupInsert(ctx context.Context, g *ModelGroup) error {
	g.CreatedAt, g.UpdatedAt = t.now, t.now
	return translate(t.q.ModelGroupInsert(ctx, t.tx, dbsqlc.ModelGroupInsertParams{Name: g.Name, Description: g.Description, PlatformWide: g.PlatformWide, Routing: routingOrEmpty(g.Routing), CreatedAt: t.now}))
}

// ModelGroupGetForUpdate returns model group name locked for the rest of
// the transaction.
func (t *Tx) ModelGroupGetForUpdate(ctx context.Context, name string) (ModelGroup, error) {
	r, err := t.q.ModelGroupGetForUpdate(ctx, t.tx, name)
	if err != nil {
		return ModelGroup{}, orNotFound(err, "model group "+name)
	}
	return modelGroupFromRow(r), nil
}

// ModelGroupUpdate writes g's description and platform-wide mark.
func (t *Tx) ModelGroupUpdate(ctx context.Context, g *ModelGroup) error {
	g.UpdatedAt = t.now
	return translate(t.q.ModelGroupUpdate(ctx, t.tx, dbsqlc.ModelGroupUpdateParams{Name: g.Name, Description: g.Description, PlatformWide: g.PlatformWide, Routing: routingOrEmpty(g.Routing), UpdatedAt: t.now}))
}

// ModelGroupDelete deletes model group name. It fails with
// ErrFailedPrecondition while the group has deployments.
func (t *Tx) ModelGroupDelete(ctx context.Context, name string) error {
	n, err := t.q.ModelGroupDeploymentCount(ctx, t.tx, name)
	if err != nil {
		return fmt.Errorf("count deployments of model group %s: %w", name, err)
	}
	if n > 0 {
		return &Error{Code: ErrFailedPrecondition, Msg: fmt.Sprintf(
			"model group %s still has %d deployments; delete them first", name, n)}
	}
	return translate(t.q.ModelGroupDelete(ctx, t.tx, name))
}

// ModelGroupGet returns model group name inside the transaction (without
// locking it; inserting a deployment takes a key-share lock through the
// foreign key).
func (t *Tx) ModelGroupGet(ctx context.Context, name string) (ModelGroup, error) {
	r, err := t.q.ModelGroupGet(ctx, t.tx, name)
	if err != nil {
		return ModelGroup{}, orNotFound(err, "model group "+name)
	}
	return modelGroupFromRow(r), nil
}

// DeploymentGet returns deployment id.
func (s *Store) DeploymentGet(ctx context.Context, id string) (Deployment, error) {
	r, err := s.q.DeploymentGet(ctx, s.pool, id)
	if err != nil {
		return Deployment{}, orNotFound(err, "deployment "+id)
	}
	return deploymentFromRow(r)
}

// DeploymentQuery filters DeploymentList.
type DeploymentQuery struct {
	// ModelGroup, when set, confines the list to one group.
	ModelGroup string
}

// DeploymentList returns a page of deployments in id order.
func (s *Store) DeploymentList(ctx context.Context, q DeploymentQuery, p Page) ([]Deployment, error) {
	rows, err := s.q.DeploymentList(ctx, s.pool, dbsqlc.DeploymentListParams{
		AfterID: p.After, ModelGroup: optStr(q.ModelGroup), Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list deployments: %w", err)
	}
	return deploymentsFromRows(rows)
}

// DeploymentInsert creates d; CreatedAt/UpdatedAt are set to the
// transaction time.
func (t *Tx) DeploymentInsert(ctx context.Context, d *Deployment) error {
	d.CreatedAt, d.UpdatedAt = t.now, t.now
	d.Tags = tagsOrEmpty(d.Tags)
	return translate(t.q.DeploymentInsert(ctx, t.tx, dbsqlc.DeploymentInsertParams{
		ID: d.ID, ModelGroup: d.ModelGroup, ApiBase: d.APIBase, UpstreamModel: d.UpstreamModel,
		CredentialCiphertext: d.CredentialCiphertext, Weight: d.Weight, MaxConcurrency: d.MaxConcurrency,
		Capabilities: capabilitiesJSON(d.Capabilities), Tags: d.Tags, InputPrice: d.InputPrice,
		OutputPrice: d.OutputPrice, CachedInputPrice: d.CachedInputPrice, Free: d.Free, CreatedAt: t.now,
	}))
}

// DeploymentGetForUpdate returns deployment id locked for the rest of the
// transaction.
func (t *Tx) DeploymentGetForUpdate(ctx context.Context, id string) (Deployment, error) {
	r, err := t.q.DeploymentGetForUpdate(ctx, t.tx, id)
	if err != nil {
		return Deployment{}, orNotFound(err, "deployment "+id)
	}
	return deploymentFromRow(r)
}

// DeploymentUpdate writes every mutable field of d (its group and id never
// change).
func (t *Tx) DeploymentUpdate(ctx context.Context, d *Deployment) error {
	d.UpdatedAt = t.now
	d.Tags = tagsOrEmpty(d.Tags)
	return translate(t.q.DeploymentUpdate(ctx, t.tx, dbsqlc.DeploymentUpdateParams{
		ID: d.ID, ApiBase: d.APIBase, UpstreamModel: d.UpstreamModel,
		CredentialCiphertext: d.CredentialCiphertext, Weight: d.Weight, MaxConcurrency: d.MaxConcurrency,
		Capabilities: capabilitiesJSON(d.Capabilities), Tags: d.Tags, InputPrice: d.InputPrice,
		OutputPrice: d.OutputPrice, CachedInputPrice: d.CachedInputPrice, Free: d.Free, UpdatedAt: t.now,
	}))
}

// DeploymentDelete deletes deployment id.
func (t *Tx) DeploymentDelete(ctx context.Context, id string) error {
	return translate(t.q.DeploymentDelete(ctx, t.tx, id))
}

// ModelGroupGrantOrgs returns the orgs model group name is granted to,
// sorted, inside the transaction.
func (t *Tx) ModelGroupGrantOrgs(ctx context.Context, name string) ([]string, error) {
	orgs, err := t.q.ModelGroupGrantOrgs(ctx, t.tx, name)
	if err != nil {
		return nil, fmt.Errorf("read grants of model group %s: %w", name, err)
	}
	return orgs, nil
}

// routingOrEmpty is the stored form of no routing settings.
func routingOrEmpty(b []byte) []byte {
	if len(b) == 0 {
		return []byte("{}")
	}
	return b
}
