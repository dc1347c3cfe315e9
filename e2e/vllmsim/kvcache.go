package vllmsim

// kvCache is the paged KV cache of the simulated engine, modelled on vLLM
// v1's BlockPool and KVCacheManager:
//
//   - NumGPUBlocks blocks of BlockSize tokens; block 0 is vLLM's reserved
//     null block and is never handed out, so NumGPUBlocks-1 blocks are usable;
//   - free blocks form an LRU queue: allocation pops from the head, freed
//     blocks are appended to the tail, a sequence's blocks in reverse order so
//     that its tail is evicted before its prefix;
//   - with prefix caching, every full block of a sequence gets a hash chained
//     over all the tokens before it; a freed block keeps its hash (and stays a
//     prefix-cache hit) until the free queue hands it out again.
type kvCache struct {
	blockSize int
	blocks    []kvBlock
	// free list: a doubly linked list through kvBlock.prev/next; -1 ends it.
	freeHead, freeTail int32
	numFree            int
	caching            bool
	cached             map[uint64]int32 // block hash → block holding it
}

type kvBlock struct {
	ref        int32
	prev, next int32
	inFree     bool
	hashed     bool
	hash       uint64
}

func newKVCache(numBlocks, blockSize int, caching bool) *kvCache {
	c := &kvCache{
		blockSize: blockSize,
		blocks:    make([]kvBlock, numBlocks),
		freeHead:  -1,
		freeTail:  -1,
		caching:   caching,
	}
	if caching {
		c.cached = make(map[uint64]int32)
	}
	for id := int32(1); id < int32(numBlocks); id++ {
		c.pushFree(id)
	}
	return c
}

// usable is the number of blocks sequences can hold (all but the null block).
func (c *kvCache) usable() int { return len(c.blocks) - 1 }

// usage is vLLM's kv_cache_usage_perc: the fraction of usable blocks that are
// not free. Cached blocks nobody references count as free.
func (c *kvCache) usage() float64 {
	if c.usable() == 0 {
		return 0
	}
	return 1 - float64(c.numFree)/float64(c.usable())
}

func (c *kvCache) pushFree(id int32) {
	b := &c.blocks[id]
	b.inFree = true
	b.prev, b.next = c.freeTail, -1
	if c.freeTail >= 0 {
		c.blocks[c.freeTail].next = id
	} else {
		c.freeHead = id
	}
	c.freeTail = id
	c.numFree++
}

func (c *kvCache) removeFree(id int32) {
	b := &c.blocks[id]
	if b.prev >= 0 {
		c.blocks[b.prev].next = b.next
	} else {
		c.freeHead = b.next
	}
	if b.next >= 0 {
		c.blocks[b.next].prev = b.prev
	} else {
		c.freeTail = b.prev
	}
	b.inFree = false
	b.prev, b.next = -1, -1
	c.numFree--
}

// popFree takes the least recently freed block, evicting its cached hash.
func (c *kvCache) popFree() int32 {
	id := c.freeHead
	c.removeFree(id)
	b := &c.blocks[id]
	if b.hashed {
		if c.cached[b.hash] == id {
			delete(c.cached, b.hash)
		}
		b.hashed = false
	}
	b.ref = 1
	return id
}

// blocksFor is the number of blocks that hold n tokens.
func (c *kvCache) blocksFor(n int) int { return (n + c.blockSize - 1) / c.blockSize }

// lookup returns the blocks of seq's longest cached prefix, as vLLM's
// get_computed_blocks does: whole blocks only, and never the last token (at
// least one token must be computed to sample the next one).
func (c *kvCache) lookup(seq *Sequence, dst []int32) []int32 {
	dst = dst[:0]
	if !c.caching {
		return dst
	}
	maxBlocks := (seq.NumTokens() - 1) / c.blockSize
	c.ensureHashes(seq, maxBlocks)
	for i := 0; i < maxBlocks; i++ {
		id, ok := c.cached[seq.blockHashes[i]]
		if !ok {
			break
		}
		dst = append(dst, id)
	}
	return dst
}

// ensureHashes extends seq.blockHashes to cover its first n full blocks.
func (c *kvCache) ensureHashes(seq *Sequence, n int) {
	for i := len(seq.blockHashes); i < n; i++ {
		h := seq.hashSeed
		if i > 0 {
			h = seq.blockHashes[i-1]
		}
		for j := i * c.blockSize; j < (i+1)*c.blockSize; j++ {
			h = mix64(h ^ uint64(seq.tokenAt(j)))
		}
		seq.blockHashes = append(seq.blockHashes, h)
	}
}

// allocate grows seq's block table so that it holds numTokens tokens. hits are
// prefix-cache blocks to adopt first (only for a sequence that holds no
// blocks yet); reserveTokens, when larger than numTokens, must also fit in the
// free pool (vLLM's scheduler_reserve_full_isl). It allocates nothing and
// returns false when the free pool is too small.
func (c *kvCache) allocate(seq *Sequence, hits []int32, numTokens, reserveTokens int) bool {
	held := len(seq.blocks) + len(hits)
	need := c.blocksFor(numTokens) - held
	if need < 0 {
		need = 0
	}
	// Cached hits that nobody references sit in the free queue: adopting them
	// takes them out of it, so they do not count as free for this request.
	evictable := 0
	for _, id := range hits {
		if c.blocks[id].ref == 0 {
			evictable++
		}
	}
	avail := c.numFree - evictable
	if need > avail {
		return false
	}
	if reserve := c.blocksFor(reserveTokens) - held; reserveTokens > numTokens && reserve > avail {
		return false
	}
	for _, id := range hits {
		b := &c.blocks[id]
		if b.ref == 0 {
			c.removeFree(id)
		}
		b.ref++
		seq.blocks = append(seq.blocks, id)
	}
	for range need {
		seq.blocks = append(seq.blocks, c.popFree())
	}
	c.cacheFull(seq, numTokens)
	return true
}

// cacheFull registers the hashes of seq's blocks that numTokens fills
// completely. A hash already held by another block is left with that block.
func (c *kvCache) cacheFull(seq *Sequence, numTokens int) {
	if !c.caching {
		return
	}
	full := numTokens / c.blockSize
	if full <= seq.numCachedBlocks {
		return
	}
	c.ensureHashes(seq, full)
	for i := seq.numCachedBlocks; i < full; i++ {
		id := seq.blocks[i]
		b := &c.blocks[id]
		h := seq.blockHashes[i]
		if b.hashed {
			continue // adopted from the cache: already registered
		}
		if _, dup := c.cached[h]; dup {
			continue
		}
		b.hashed, b.hash = true, h
		c.cached[h] = id
	}
	seq.numCachedBlocks = full
}

// free releases seq's blocks, tail first.
func (c *kvCache) free(seq *Sequence) {
	for i := len(seq.blocks) - 1; i >= 0; i-- {
		id := seq.blocks[i]
		b := &c.blocks[id]
		b.ref--
		if b.ref == 0 {
			c.pushFree(id)
		}
	}
	seq.blocks = seq.blocks[:0]
	seq.numCachedBlocks = 0
}

// mix64 is the SplitMix64 finaliser: a cheap, well-distributed 64-bit mix.
func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}
