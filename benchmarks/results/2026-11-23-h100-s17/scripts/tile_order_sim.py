"""Session 17: greedy list scheduling of the gradients kernel's causal tiles (work = steps) on 132 SMs, one CTA
each: makespan and busy share for every pair together (longest_first), head after head, and runs of G pairs."""
import heapq
def sim(order, work, sms=132):
    free=[(0.0,i) for i in range(sms)]; heapq.heapify(free); end=0; busy=0
    for t in order:
        s,i=heapq.heappop(free); e=s+work[t]; busy+=work[t]; end=max(end,e); heapq.heappush(free,(e,i))
    return end, busy/(end*sms)
KB=32; groups=32; mblocks=64
work={(g,j):4*(mblocks-2*j) for g in range(groups) for j in range(KB)}
orders={
 'head_after_head':[(g,j) for g in range(groups) for j in range(KB)],
 'longest_first':[(g,j) for j in range(KB) for g in range(groups)],
}
for G in (2,4,8,16):
  orders[f'super{G}']=[(g0+g,j) for g0 in range(0,groups,G) for j in range(KB) for g in range(G)]
# longest-first only in the last wave-ish chunk
for name,o in orders.items():
  e,u=sim(o,work); print(f"{name:16s} makespan {e:8.1f} busy {u:.3f}")
print()
for (B,S,H,HK,bm) in [(4,4096,32,8,64),(4,4096,32,8,128),(1,16384,32,8,64),(2,8192,32,8,64),(4,2048,32,8,64),(8,1024,32,8,64),(4,4096,32,4,64),(4,4096,28,4,64),(1,4096,32,8,64),(2,4096,16,2,64)]:
  KB=S//128; groups=B*HK; mb=S//bm; grp=H//HK
  work={(g,j):grp*(mb-j*128//bm) for g in range(groups) for j in range(KB)}
  lf=[(g,j) for j in range(KB) for g in range(groups)]
  hh=[(g,j) for g in range(groups) for j in range(KB)]
  G=max(1,132//KB)
  sg=[(g0+g,j) for g0 in range(0,groups,G) for j in range(KB) for g in range(G) if g0+g<groups]
  r=[sim(o,work) for o in (lf,hh,sg)]
  print(B,S,H,HK,bm,'G',G, ' '.join(f"{e:.0f}/{u:.3f}" for e,u in r))
print('H32/32')
for (B,S,H,HK,bm) in [(4,4096,32,32,64),(4,4096,32,32,128)]:
  KB=S//128; groups=B*HK; mb=S//bm; grp=H//HK
  work={(g,j):grp*(mb-j*128//bm) for g in range(groups) for j in range(KB)}
  lf=[(g,j) for j in range(KB) for g in range(groups)]
  hh=[(g,j) for g in range(groups) for j in range(KB)]
  G=max(1,132//KB)
  sg=[(g0+g,j) for g0 in range(0,groups,G) for j in range(KB) for g in range(G) if g0+g<groups]
  r=[sim(o,work) for o in (lf,hh,sg)]
  print(B,S,H,HK,bm,'G',G, ' '.join(f"{e:.0f}/{u:.3f}" for e,u in r))
